//! SmolLM2's chat template (the GGUF's `tokenizer.chat_template`) for one user message, with
//! the prompt for the assistant's answer:
//!
//! ```text
//! <|im_start|>system
//! You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
//! <|im_start|>user
//! {prompt}<|im_end|>
//! <|im_start|>assistant
//! ```
//!
//! (The template writes this system message when the conversation opens without one; the
//! control tokens are matched whole by the tokenizer.)

/// The system message SmolLM2's template adds.
pub const SYSTEM: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// The template applied to one user message, ready for the assistant's first token.
pub fn user_turn(prompt: &str) -> String {
    format!(
        "<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
}

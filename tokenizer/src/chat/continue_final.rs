//! `continue_final_message`: a prompt that ends inside its last message,
//! so the model continues that message (an assistant's partial answer)
//! instead of starting a new turn.
//!
//! vLLM and SGLang render the conversation with `add_generation_prompt`
//! off and hand it to Hugging Face's `apply_chat_template`, which cuts
//! the rendered text right after the last occurrence of the final
//! message's content ([`cut_after_final`], the same rule): whatever the
//! template writes after a message (an end-of-turn token, a newline) is
//! dropped, and the engine generates from there.

use super::TemplateError;

/// The message Hugging Face raises when the template left the final
/// message out (or changed it beyond its surrounding whitespace).
pub const NOT_IN_RENDERING: &str = "continue_final_message is set but the final message does not appear in the chat \
     after applying the chat template! This can happen if the chat template deletes portions of the final message. \
     Please verify the chat template and final message in your chat to ensure they are compatible.";

/// Cuts `rendered` (a conversation rendered without a generation prompt)
/// right after its final message's `content`, as `apply_chat_template`
/// does with `continue_final_message=True`: at the last occurrence of the
/// content stripped of surrounding whitespace, keeping the content's
/// trailing whitespace only when the template kept the content as it is.
pub fn cut_after_final(rendered: &mut String, content: &str) -> Result<(), TemplateError> {
    let stripped = content.trim();
    let Some(at) = rendered.rfind(stripped) else {
        return Err(TemplateError::Render(NOT_IN_RENDERING.to_owned()));
    };
    let lstripped = content.trim_start();
    // Python compares `rendered[at : at + len(lstripped)]` with the
    // content itself: equal only when the content has no leading space.
    let kept_whole = rendered.get(at..at + lstripped.len()) == Some(content);
    let end = at + if kept_whole { lstripped.len() } else { stripped.len() };
    rendered.truncate(end);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(rendered: &str, content: &str) -> Result<String, TemplateError> {
        let mut s = rendered.to_owned();
        cut_after_final(&mut s, content).map(|()| s)
    }

    #[test]
    fn the_rendering_ends_inside_the_final_message() {
        // ChatML: the end-of-turn token and newline after it go.
        let chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe river is<|im_end|>\n";
        assert_eq!(
            cut(chatml, "The river is").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe river is"
        );
        // A leading space the template kept stays; the cut is after the
        // stripped content.
        let canonical = "<|user|>\nHi\n<|assistant|>\n the river\n<|assistant|>\n";
        assert_eq!(
            cut(canonical, " the river").unwrap(),
            "<|user|>\nHi\n<|assistant|>\n the river"
        );
        // Trailing whitespace the template kept stays; one it trimmed does not.
        assert_eq!(cut("<a>x y \n</a>", "x y \n").unwrap(), "<a>x y \n");
        assert_eq!(cut("<a>x y</a>", "x y \n").unwrap(), "<a>x y");
        // The last occurrence: an earlier message with the same words.
        assert_eq!(cut("A: ok\nB: ok\n", "ok").unwrap(), "A: ok\nB: ok");
        // Empty content: nothing is cut (Python's rindex of "" is the end).
        assert_eq!(cut("abc", "").unwrap(), "abc");
        // Multi-byte text is cut at a character boundary.
        assert_eq!(cut("<a>café — ok</a>", "café — ok").unwrap(), "<a>café — ok");
    }

    #[test]
    fn a_template_that_drops_the_final_message_is_an_error() {
        let e = cut("<|user|>\nHi\n", "the river").unwrap_err();
        assert!(e.to_string().contains("does not appear in the chat"), "{e}");
    }
}

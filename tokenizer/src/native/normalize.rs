//! The normalizers the native engine reproduces: none, or Unicode NFC.
//!
//! NFC is computed with the very crate and version HF `tokenizers` uses
//! (`unicode-normalization-alignments` 0.1.12, Unicode 9.0 tables), so the
//! result is HF's by construction. Most text is already in NFC and is
//! returned as it is without copying: text whose characters are all below
//! U+0300 (no UTF-8 byte ≥ 0xCC: no combining mark can occur) at the cost of
//! one byte scan, and other text that passes the crate's NFC quick check.

use std::borrow::Cow;

use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

/// A tokenizer's normalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Normalizer {
    /// None (`"normalizer": null`).
    Identity,
    /// Unicode NFC (`{"type": "NFC"}`).
    Nfc,
}

impl Normalizer {
    /// `text` normalized.
    pub(crate) fn apply(self, text: &str) -> Cow<'_, str> {
        match self {
            Normalizer::Identity => Cow::Borrowed(text),
            Normalizer::Nfc => nfc(text),
        }
    }
}

/// `text` in NFC.
pub(crate) fn nfc(text: &str) -> Cow<'_, str> {
    if text.bytes().all(|b| b < 0xCC) || is_nfc_quick(text.chars()) == IsNormalized::Yes {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.nfc().map(|(c, _)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokenizers::normalizers::unicode::NFC;
    use tokenizers::{NormalizedString, Normalizer as _};

    fn hf(text: &str) -> String {
        let mut n = NormalizedString::from(text);
        NFC.normalize(&mut n).unwrap();
        n.get().to_owned()
    }

    #[test]
    fn composes_like_hf() {
        for text in [
            "e\u{301}",
            "\u{1100}\u{1161}\u{11a8}",
            "a\u{323}\u{302}",
            "\u{212b}",
            "abc",
            "é",
            "ḍ̇",
        ] {
            assert_eq!(nfc(text), hf(text), "{text:?}");
        }
        assert!(matches!(nfc("plain ascii and ÿ"), Cow::Borrowed(_)));
    }

    #[test]
    fn every_code_point_alone_and_after_a_letter() {
        let mut buf = String::new();
        for cp in 0u32..=0x10FFFF {
            let Some(c) = char::from_u32(cp) else { continue };
            buf.push('e');
            buf.push(c);
            buf.push(c);
            if cp % 256 == 255 {
                assert_eq!(nfc(&buf), hf(&buf), "around U+{cp:04X}");
                buf.clear();
            }
        }
    }

    proptest! {
        #[test]
        fn random_mark_sequences(chars in prop::collection::vec(prop::sample::select(vec![
            'a', 'e', 'A', 'ᄀ', 'ᅡ', 'ᆨ', '가', '\u{300}', '\u{301}', '\u{323}', '\u{302}', '\u{308}', '\u{345}',
            '\u{f71}', '\u{f72}', '\u{f74}', 'Å', '\u{212b}', 'ω', '\u{342}', ' ', 'ǘ']), 0..16)) {
            let text: String = chars.into_iter().collect();
            prop_assert_eq!(nfc(&text), hf(&text));
        }
    }
}

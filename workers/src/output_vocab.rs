//! The deterministic output tokens the simulator "generates".
//!
//! [`OutputVocab`] is the set of words the simulator "generates": common
//! English words that are exactly one token with a leading space and decode
//! back to themselves, so a generated answer re-tokenizes to the very ids
//! that were generated when a client sends it back in the next turn.

use semlb_tokenizer::Tokenizer;

/// Candidate output words: common English words, lowercase letters only.
/// [`OutputVocab::new`] keeps those that are one token with a leading space.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "she", "other", "its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "out",
    "could", "first", "new", "two", "any", "our", "about", "also", "over", "then", "most", "like", "made", "after",
    "such", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well", "down",
    "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make",
    "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under",
    "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come",
    "since", "against", "go", "came", "right", "used", "take", "three", "small", "large", "next", "early", "water",
    "house", "number", "part", "place", "case", "point", "group", "problem", "fact", "hand", "high", "home", "light",
    "night", "open", "order", "city", "name", "line", "play", "power", "story", "system", "game", "form", "book",
    "idea", "head", "face", "school", "family", "question", "word", "side", "area", "road", "land", "river", "music",
    "table", "tree", "stone", "green", "blue", "red", "white", "black", "cold", "warm", "quick", "slow", "simple",
    "clear", "short", "young", "happy", "real", "true", "free", "full", "strong", "wide", "deep", "close",
];

/// The words the simulator "generates": single tokens, so generated ids
/// re-tokenize to themselves when a client sends the answer back.
#[derive(Debug, Clone)]
pub struct OutputVocab {
    words: Vec<u32>,
}

impl OutputVocab {
    /// Picks the vocabulary for `tokenizer`: the built-in common words for
    /// which `encode(" " + word)` is exactly one token that decodes back to
    /// `" " + word`. Should no word qualify (an exotic tokenizer), the
    /// single lowercase letters that are one token each are used, and as a
    /// last resort the first token of `"a"`.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let single = |text: &str| match tokenizer.encode(text).as_slice() {
            &[id] if tokenizer.decode(&[id]) == text => Some(id),
            _ => None,
        };
        let mut words: Vec<u32> = WORDS.iter().filter_map(|word| single(&format!(" {word}"))).collect();
        if words.is_empty() {
            words = ('a'..='z').filter_map(|c| single(&c.to_string())).collect();
        }
        if words.is_empty() {
            words.push(tokenizer.encode("a").first().copied().unwrap_or(0));
        }
        words.sort_unstable();
        words.dedup();
        Self { words }
    }

    /// `n` output token ids, a deterministic function of `seed` (each drawn
    /// uniformly from [`ids`](Self::ids) with splitmix64).
    pub fn generate(&self, seed: u64, n: usize) -> Vec<u32> {
        let mut state = seed;
        let len = self.words.len() as u128;
        (0..n)
            .map(|_| {
                let index = (u128::from(splitmix64(&mut state)) * len) >> 64;
                self.words[index as usize]
            })
            .collect()
    }

    /// The token ids that can be generated, sorted.
    pub fn ids(&self) -> &[u32] {
        &self.words
    }
}

/// The splitmix64 generator: advances `state` and returns the next value.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use semlb_tokenizer::chat::{ChatMessage, ChatTemplate};
    use semlb_tokenizer::test_data;

    fn qwen3() -> Option<Tokenizer> {
        test_data::tokenizer_file("qwen3-tokenizer.json")
            .map(|p| Tokenizer::from_file(&p).expect("Qwen3 tokenizer loads"))
    }

    fn qwen3_template() -> Option<ChatTemplate> {
        test_data::tokenizer_file("qwen3-tokenizer_config.json")
            .map(|p| ChatTemplate::from_tokenizer_config(&p).expect("Qwen3 chat template loads"))
    }

    fn msg(role: &str, content: &str) -> ChatMessage<'static> {
        ChatMessage::new(role.to_owned(), content.to_owned())
    }

    #[test]
    fn canonical_next_turn_extends_prompt_and_answer_exactly() {
        let t = ChatTemplate::canonical();
        let turn1 = vec![msg("system", "You are helpful."), msg("user", "Name three rivers.")];
        let answer = " the river water and";
        let mut turn2 = turn1.clone();
        turn2.push(msg("assistant", answer));
        turn2.push(msg("user", "And three lakes?"));
        let rest = t.render(&[msg("user", "And three lakes?")]).unwrap();
        let p1 = t.render(&turn1).unwrap();
        let p2 = t.render(&turn2).unwrap();
        assert_eq!(format!("{p1}{answer}\n{rest}"), p2);

        // And at the token level, with generated words as the answer: the
        // ids of turn 1's prompt and answer are a prefix of turn 2's ids.
        let tok = Tokenizer::bundled();
        let vocab = OutputVocab::new(&tok);
        let generated = vocab.generate(7, 40);
        let answer = tok.decode(&generated);
        let mut turn2 = turn1.clone();
        turn2.push(msg("assistant", &answer));
        turn2.push(msg("user", "More?"));
        let mut expect = tok.encode(&p1);
        expect.extend_from_slice(&generated);
        let ids2 = tok.encode(&t.render(&turn2).unwrap());
        assert_eq!(ids2[..expect.len()], expect[..]);
    }

    /// The token-level version with the real Qwen3 tokenizer: turn 1's
    /// prompt ids followed by the generated ids are a prefix of turn 2's ids.
    #[test]
    fn qwen3_next_turn_reuses_prompt_and_generated_ids() {
        let (Some(t), Some(tok)) = (qwen3_template(), qwen3()) else {
            return;
        };
        let vocab = OutputVocab::new(&tok);
        let turn1 = vec![
            msg("system", "You are a helpful assistant."),
            msg("user", "Name three rivers."),
        ];
        let p1 = t.render(&turn1).unwrap();
        for seed in 0..20 {
            let generated = vocab.generate(seed, 64);
            let mut turn2 = turn1.clone();
            turn2.push(msg("assistant", &tok.decode(&generated)));
            turn2.push(msg("user", "And three lakes?"));
            let ids2 = tok.encode(&t.render(&turn2).unwrap());
            let mut expect = tok.encode(&p1);
            expect.extend_from_slice(&generated);
            expect.push(151645); // <|im_end|>
            assert_eq!(ids2[..expect.len()], expect[..], "seed {seed}");
        }
    }

    fn check_vocab(tok: &Tokenizer) {
        let vocab = OutputVocab::new(tok);
        assert!(vocab.ids().len() >= 150, "only {} words qualify", vocab.ids().len());
        assert_eq!(vocab.generate(42, 100), vocab.generate(42, 100));
        assert_ne!(vocab.generate(42, 100), vocab.generate(43, 100));
        assert_eq!(vocab.generate(5, 0), Vec::<u32>::new());
        // A longer draw is an extension of a shorter one.
        assert_eq!(vocab.generate(9, 300)[..10], vocab.generate(9, 10)[..]);
        for seed in 0..50 {
            let ids = vocab.generate(seed, 200);
            assert!(ids.iter().all(|id| vocab.ids().contains(id)));
            let text = tok.decode(&ids);
            assert!(text.starts_with(' '));
            assert_eq!(tok.encode(&text), ids, "seed {seed}: {text:?}");
        }
        // Draws spread over the vocabulary.
        let drawn: std::collections::HashSet<u32> = vocab.generate(1, 5000).into_iter().collect();
        assert!(
            drawn.len() * 10 >= vocab.ids().len() * 9,
            "{} of {}",
            drawn.len(),
            vocab.ids().len()
        );
    }

    #[test]
    fn output_vocab_round_trips_bundled() {
        check_vocab(&Tokenizer::bundled());
    }

    #[test]
    fn output_vocab_round_trips_qwen3() {
        let Some(tok) = qwen3() else { return };
        check_vocab(&tok);
    }

    #[test]
    fn output_vocab_words_are_single_tokens() {
        let tok = Tokenizer::bundled();
        let vocab = OutputVocab::new(&tok);
        assert!(vocab.ids().contains(&262)); // " the"
        assert!(WORDS.len() >= 200);
        assert!(
            WORDS
                .iter()
                .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase()))
        );
    }

    #[test]
    fn splitmix64_known_values() {
        // Reference values of splitmix64 seeded with 0.
        let mut state = 0;
        assert_eq!(splitmix64(&mut state), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(&mut state), 0x6E78_9E6A_A1B9_65F4);
    }
}

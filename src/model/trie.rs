//! Prefix tree over tokenised admissible actions, used for constrained
//! decoding: at every step a sequence may only emit a token that keeps its
//! generated prefix on a path of the tree, and may emit eos only where a
//! complete action ends.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
struct Node {
    /// Children keyed by token id; a BTreeMap so `allowed` is sorted and
    /// generation is deterministic.
    children: BTreeMap<u32, usize>,
    /// A whole action ends here (eos is allowed next).
    complete: bool,
}

/// Token trie over a set of actions (token-id sequences) plus the eos id that
/// terminates each action.
#[derive(Debug, Clone)]
pub struct TokenTrie {
    nodes: Vec<Node>,
    eos_token_id: u32,
}

impl TokenTrie {
    /// Builds the trie. Duplicate actions are merged; an action may be a
    /// prefix of another ("cabinet 1" vs "cabinet 10"), in which case both
    /// eos and the longer continuation are allowed after the shorter one.
    /// An empty action makes eos admissible immediately.
    pub fn new(actions: &[Vec<u32>], eos_token_id: u32) -> Self {
        let mut nodes = vec![Node::default()];
        for action in actions {
            let mut cur = 0usize;
            for &tok in action {
                cur = match nodes[cur].children.get(&tok) {
                    Some(&next) => next,
                    None => {
                        nodes.push(Node::default());
                        let next = nodes.len() - 1;
                        nodes[cur].children.insert(tok, next);
                        next
                    }
                };
            }
            nodes[cur].complete = true;
        }
        TokenTrie {
            nodes,
            eos_token_id,
        }
    }

    /// The eos id this trie terminates actions with.
    pub fn eos_token_id(&self) -> u32 {
        self.eos_token_id
    }

    /// Number of distinct actions is not tracked; this says whether any
    /// action at all was given.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1 && !self.nodes[0].complete
    }

    /// Tokens allowed after `prefix` (the tokens generated so far, without
    /// eos): the children of the prefix's node in ascending id order, then
    /// eos if the prefix is a complete action. Empty when the prefix is not
    /// on any action's path (or the trie is empty).
    pub fn allowed(&self, prefix: &[u32]) -> Vec<u32> {
        let Some(node) = self.walk(prefix) else {
            return Vec::new();
        };
        let n = &self.nodes[node];
        let mut out: Vec<u32> = n.children.keys().copied().collect();
        if n.complete && !n.children.contains_key(&self.eos_token_id) {
            out.push(self.eos_token_id);
        }
        out
    }

    /// True when `tokens` is exactly one of the actions.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.walk(tokens).is_some_and(|n| self.nodes[n].complete)
    }

    fn walk(&self, prefix: &[u32]) -> Option<usize> {
        let mut cur = 0usize;
        for tok in prefix {
            cur = *self.nodes[cur].children.get(tok)?;
        }
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_sets() {
        // "cabinet 1" = [5, 7], "cabinet 10" = [5, 7, 9], "look" = [3]
        let t = TokenTrie::new(&[vec![5, 7], vec![5, 7, 9], vec![3], vec![5, 7]], 2);
        assert_eq!(t.allowed(&[]), vec![3, 5]);
        assert_eq!(t.allowed(&[5]), vec![7]);
        assert_eq!(t.allowed(&[5, 7]), vec![9, 2]);
        assert_eq!(t.allowed(&[5, 7, 9]), vec![2]);
        assert_eq!(t.allowed(&[3]), vec![2]);
        assert!(t.allowed(&[4]).is_empty());
        assert!(t.allowed(&[3, 2]).is_empty());
        assert!(t.contains(&[5, 7]) && t.contains(&[5, 7, 9]) && !t.contains(&[5]));
        assert!(!t.is_empty());

        let empty = TokenTrie::new(&[], 2);
        assert!(empty.is_empty());
        assert!(empty.allowed(&[]).is_empty());
        let with_empty_action = TokenTrie::new(&[vec![]], 2);
        assert_eq!(with_empty_action.allowed(&[]), vec![2]);
    }
}

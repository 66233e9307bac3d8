//! Stop strings over streamed text: a reply ends where one of them first appears, and text is
//! released only once it can no longer turn out to be the start of one, so a streamed reply
//! never shows part of a stop string.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: it may be the start of a stop string.
    held: String,
}

/// What a new piece of text makes of the reply.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    /// Text safe to send now.
    pub text: String,
    /// A stop string appeared: the reply ends with `text`.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            return Released {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self.longest_stop_prefix_suffix();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Released {
            text,
            stopped: false,
        }
    }

    /// The held text at the end of a reply that ended otherwise.
    pub fn finish(self) -> String {
        self.held
    }

    /// Length of the longest end of `held` that begins some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let h = &self.held;
        (1..=h.len())
            .rev()
            .filter(|&n| h.is_char_boundary(h.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&h[h.len() - n..])))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces`; returns the released text and whether a stop string ended it.
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push(m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_never_shown() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            (vec!["abc ".into(), "".into(), "".into()], true)
        );
    }

    #[test]
    fn held_text_is_released_once_it_cannot_start_a_stop() {
        assert_eq!(
            run(&["END"], &["a E", "x", "y"]),
            (vec!["a ".into(), "Ex".into(), "y".into(), "".into()], false)
        );
        // A reply that ends inside a possible stop string keeps that text.
        assert_eq!(
            run(&["\n\n"], &["line\n"]),
            (vec!["line".into(), "\n".into()], false)
        );
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_unicode_is_kept_whole() {
        assert_eq!(
            run(&["é!", "b"], &["aé", "!b"]),
            (vec!["a".into(), "".into()], true)
        );
        assert_eq!(
            run(&["xyz"], &["ééé"]),
            (vec!["ééé".into(), "".into()], false)
        );
    }
}

//! Kubernetes Events as this operator publishes them: the Events API refuses a `note` over
//! 1,024 bytes, and a provider's refusal or an undecodable spec can be longer, so every note is
//! cut to fit (on a character boundary, marked with `...`) instead of losing the Event.

use kube::runtime::events::{Event, EventType};

/// The most bytes the Events API takes in a `note`.
pub const NOTE_LIMIT: usize = 1024;

/// An Event whose note fits the Events API.
pub fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.to_owned(),
        note: Some(truncate(note, NOTE_LIMIT)),
        action: action.to_owned(),
        secondary: None,
    }
}

/// `text` cut to at most `limit` bytes, ending in `...` when it was cut.
pub fn truncate(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut cut = limit.saturating_sub(3);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_to_the_events_api_limit_on_a_character_boundary() {
        let long = "é".repeat(2 * NOTE_LIMIT);
        let cut = truncate(long, NOTE_LIMIT);
        assert!(cut.len() <= NOTE_LIMIT);
        assert!(cut.ends_with("..."));
        assert_eq!(truncate("short".into(), NOTE_LIMIT), "short");
        let exact = "x".repeat(NOTE_LIMIT);
        assert_eq!(truncate(exact.clone(), NOTE_LIMIT), exact);
        let event = event(EventType::Warning, "Refused", "Create", "y".repeat(5000));
        assert_eq!(event.note.map(|n| n.len()), Some(NOTE_LIMIT));
    }
}

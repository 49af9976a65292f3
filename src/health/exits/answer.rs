//! Reading an exit check's answer: the caller's address as plain text (`api.ipify.org`,
//! `checkip.amazonaws.com`, `ifconfig.me/ip`), or a JSON object naming it in `ip`
//! (`api.ipify.org?format=json`, `ipinfo.io`) or `origin` (`httpbin.org/ip`, which may list
//! several addresses, the caller's first).

use std::net::IpAddr;

/// The most bytes of an answer read: an address and some JSON around it.
pub const MAX_ANSWER_BYTES: usize = 4096;

/// The address an answer names, or why none could be read.
pub fn exit_address(body: &[u8]) -> Result<IpAddr, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the answer is not UTF-8 text".to_owned())?;
    let text = text.trim();
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(ip);
    }
    let named = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|value| {
            ["ip", "origin"]
                .iter()
                .find_map(|key| value.get(key)?.as_str().map(str::to_owned))
        });
    let Some(named) = named else {
        return Err(format!(
            "the answer is neither an address nor JSON with \"ip\" or \"origin\": {:?}",
            shorten(text)
        ));
    };
    let first = named.split(',').next().unwrap_or_default().trim();
    first
        .parse()
        .map_err(|_| format!("the answer names {:?}, not an address", shorten(first)))
}

fn shorten(text: &str) -> String {
    text.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_name_the_address() {
        let ok = [
            ("plain", "203.0.113.7", "203.0.113.7"),
            ("plain with newline", "203.0.113.7\n", "203.0.113.7"),
            ("IPv6", "2001:db8::1\r\n", "2001:db8::1"),
            ("ipify json", r#"{"ip":"203.0.113.7"}"#, "203.0.113.7"),
            (
                "httpbin origin list",
                r#"{"origin": "203.0.113.7, 10.0.0.1"}"#,
                "203.0.113.7",
            ),
            (
                "ipinfo",
                r#"{"ip": "198.51.100.2", "country": "DE"}"#,
                "198.51.100.2",
            ),
        ];
        for (name, body, want) in ok {
            assert_eq!(
                exit_address(body.as_bytes()),
                Ok(want.parse().unwrap()),
                "{name}"
            );
        }
        let bad = [
            ("html", "<html>blocked</html>", "neither an address"),
            ("json without ip", r#"{"address": "1.2.3.4"}"#, "neither"),
            (
                "json ip not an address",
                r#"{"ip": "localhost"}"#,
                "not an address",
            ),
            ("empty", "", "neither"),
        ];
        for (name, body, want) in bad {
            let error = exit_address(body.as_bytes()).unwrap_err();
            assert!(error.contains(want), "{name}: {error}");
        }
        assert!(exit_address(&[0xff, 0xfe]).unwrap_err().contains("UTF-8"));
    }
}

//! curl as the crawler: run it with a time limit, and read the headers it printed.

use std::time::Duration;

/// Runs curl with `args`, giving up after `limit`; returns its exit code, stdout and stderr.
pub async fn curl(limit: Duration, args: &[&str]) -> (i32, String, String) {
    let seconds = limit.as_secs().max(1).to_string();
    let output = tokio::process::Command::new("curl")
        .args(["--max-time", &seconds])
        .args(args)
        .output()
        .await
        .expect("curl is installed (apt-get install -y curl)");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The value of header `name` (any case) in a response head curl printed.
pub fn header_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

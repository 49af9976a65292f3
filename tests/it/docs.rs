//! The docs (README.md, CONTRIBUTING.md, every `*.md` under docs/, clients/python/README.md)
//! cannot rot unseen:
//!
//! - every relative link or image reaches a file or directory of the repository, and its
//!   `#anchor` is a heading of the Markdown file it names (GitHub's slug) or an `<a id|name>`
//!   in it; into any other file only a GitHub line anchor (`#L10`) is allowed;
//! - every `proxy-operator` flag they name is in `--help`: on a command line (in a code block,
//!   or a code span starting `proxy-operator <sub>` or `cargo run -- <sub>`), in that
//!   subcommand's (`proxies import` counts as one, both words); as a code span of its own
//!   (`` `--ledger URL` ``), in some subcommand's.
//!   Other programs' flags are not ours;
//! - every `sqlite3` query in a code block runs on a ledger file the ledger itself created.
//!
//! Each test collects every problem of every file and fails once with the list.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{BrokenLink, Event, LinkType, Options, Parser, Tag, TagEnd};
use regex::Regex;

/// The repository root.
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files held to these rules, sorted.
fn doc_files() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![
        root.join("README.md"),
        root.join("CONTRIBUTING.md"),
        root.join("clients/python/README.md"),
    ];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        let entries =
            std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a docs/ entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// `path` relative to the repository root, for messages.
fn shown(path: &Path) -> String {
    let root = repo();
    path.strip_prefix(&root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// GitHub's Markdown: tables, footnotes, strikethrough, task lists (no `{#id}` attributes).
fn options() -> Options {
    Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

// ---- links and anchors ----

/// A heading's anchor as GitHub makes it: its text lowercased, every character but letters,
/// digits, spaces, `-` and `_` removed, spaces turned into `-`.
fn slug(text: &str) -> String {
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a link may name in Markdown `text`: its headings' slugs (a repeated one gets
/// `-1`, `-2`, … as on GitHub) and the `id`/`name` of its `<a>` tags.
fn anchors(text: &str) -> BTreeSet<String> {
    let html_anchor =
        Regex::new(r#"(?i)<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']"#).expect("a regex");
    // GitHub's slugger: how often each plain slug was seen, and every anchor handed out.
    let mut occurrences: HashMap<String, usize> = HashMap::new();
    let mut found = BTreeSet::new();
    let mut heading: Option<String> = None;
    let mut in_image = 0usize;
    for event in Parser::new_ext(text, options()) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let mut anchor = base.clone();
                while occurrences.contains_key(&anchor) {
                    let n = occurrences.entry(base.clone()).or_insert(0);
                    *n += 1;
                    anchor = format!("{base}-{n}");
                }
                occurrences.entry(anchor.clone()).or_insert(0);
                found.insert(anchor);
            }
            Event::Start(Tag::Image { .. }) => in_image += 1,
            Event::End(TagEnd::Image) => in_image = in_image.saturating_sub(1),
            Event::Text(t) | Event::Code(t) if in_image == 0 => {
                if let Some(heading) = heading.as_mut() {
                    heading.push_str(&t);
                }
            }
            Event::SoftBreak | Event::HardBreak => {
                if let Some(heading) = heading.as_mut() {
                    heading.push('\n');
                }
            }
            Event::Html(html) | Event::InlineHtml(html) => {
                for capture in html_anchor.captures_iter(&html) {
                    found.insert(capture[1].to_owned());
                }
            }
            _ => {}
        }
    }
    found
}

/// `%XX` escapes decoded (a link to `my%20file.md`); a malformed one is kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An absolute URL (`https:`, `mailto:`, any scheme) or a protocol-relative one: not ours.
fn is_absolute_url(dest: &str) -> bool {
    if dest.starts_with("//") {
        return true;
    }
    let Some((scheme, _)) = dest.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// `path` with `.` and `..` resolved without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// What the link checker saw in the files it was given.
#[derive(Debug, Default)]
struct LinkReport {
    /// Relative links and images checked.
    links: usize,
    /// Of those, the ones with an `#anchor`.
    anchored: usize,
    /// `file:line: (link): what is wrong`, one per broken link.
    broken: Vec<String>,
}

/// Checks every relative link and image of Markdown `text`, which is the file `file` (so
/// `#anchor` alone names one of `text`'s own anchors); links starting with `/` are relative to
/// `root`. Adds to `report`; `cache` keeps the anchors of the files read so far.
fn check_links(
    file: &Path,
    text: &str,
    root: &Path,
    cache: &mut HashMap<PathBuf, BTreeSet<String>>,
    report: &mut LinkReport,
) {
    let here = file.parent().unwrap_or(root);
    let own = anchors(text);
    let mut broken_refs: Vec<(Range<usize>, String)> = Vec::new();
    let mut links: Vec<(Range<usize>, String)> = Vec::new();
    {
        let callback = |link: BrokenLink<'_>| {
            // `[text][label]` with no `[label]: …` shows as plain text: the link is lost.
            // (`[text]` alone is too often meant as brackets to count.)
            if link.link_type == LinkType::Reference {
                broken_refs.push((link.span.clone(), link.reference.to_string()));
            }
            None
        };
        let parser = Parser::new_with_broken_link_callback(text, options(), Some(callback));
        for (event, range) in parser.into_offset_iter() {
            match event {
                Event::Start(Tag::Link {
                    link_type,
                    dest_url,
                    ..
                })
                | Event::Start(Tag::Image {
                    link_type,
                    dest_url,
                    ..
                }) if !matches!(link_type, LinkType::Autolink | LinkType::Email) => {
                    links.push((range, dest_url.to_string()));
                }
                _ => {}
            }
        }
    }
    for (range, label) in broken_refs {
        report.broken.push(format!(
            "{}:{}: [{label}]: no link reference definition `[{label}]: …`",
            shown(file),
            line_of(text, range.start)
        ));
    }
    for (range, dest) in links {
        if is_absolute_url(&dest) {
            continue;
        }
        report.links += 1;
        let problem = link_problem(file, here, root, &own, &dest, cache);
        if dest.contains('#') {
            report.anchored += 1;
        }
        if let Some(problem) = problem {
            report.broken.push(format!(
                "{}:{}: ({dest}): {problem}",
                shown(file),
                line_of(text, range.start)
            ));
        }
    }
}

/// What is wrong with relative link `dest` of `file` (in directory `here`), if anything.
fn link_problem(
    file: &Path,
    here: &Path,
    root: &Path,
    own: &BTreeSet<String>,
    dest: &str,
    cache: &mut HashMap<PathBuf, BTreeSet<String>>,
) -> Option<String> {
    let (path, anchor) = match dest.split_once('#') {
        Some((path, anchor)) => (path, Some(percent_decode(anchor))),
        None => (dest, None),
    };
    let path = path.split_once('?').map_or(path, |(path, _query)| path);
    let path = percent_decode(path);
    let target = if path.is_empty() {
        file.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        normalize(&root.join(from_root))
    } else {
        normalize(&here.join(&path))
    };
    if !path.is_empty() && !target.exists() {
        return Some(format!("{} does not exist", shown(&target)));
    }
    let anchor = anchor.filter(|anchor| !anchor.is_empty())?;
    let markdown = path.is_empty()
        || (target.is_file()
            && target
                .extension()
                .is_some_and(|ext| ext == "md" || ext == "markdown"));
    if !markdown {
        let line = Regex::new(r"^L[0-9]+(C[0-9]+)?(-L[0-9]+(C[0-9]+)?)?$").expect("a regex");
        return (!line.is_match(&anchor)).then(|| {
            format!(
                "#{anchor} into {}, which is not Markdown (only a line anchor like #L10 is)",
                shown(&target)
            )
        });
    }
    let known = if path.is_empty() {
        own
    } else {
        cache
            .entry(target.clone())
            .or_insert_with(|| anchors(&read(&target)))
    };
    (!known.contains(&anchor))
        .then(|| format!("{} has no heading or anchor #{anchor}", shown(&target)))
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let root = repo();
    let mut cache = HashMap::new();
    let mut report = LinkReport::default();
    let files = doc_files();
    for file in &files {
        check_links(file, &read(file), &root, &mut cache, &mut report);
    }
    assert!(
        report.broken.is_empty(),
        "{} broken links in the docs:\n{}",
        report.broken.len(),
        report.broken.join("\n")
    );
    // An extractor that finds nothing must not pass.
    assert!(
        report.links >= 20 && report.anchored >= 5,
        "only {} relative links ({} with an anchor) found in {} files: is the extractor broken?",
        report.links,
        report.anchored,
        files.len()
    );
    eprintln!(
        "docs: {} relative links ({} with an anchor) in {} files resolve",
        report.links,
        report.anchored,
        files.len()
    );
}

#[test]
fn the_link_checker_reports_exactly_the_broken_links() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let other = "# Other page\n\n## The `run` *command*\n\n## Twice\n\n## Twice\n\n\
                 <a id=\"explicit\"></a>\n";
    std::fs::write(dir.path().join("other.md"), other).expect("write other.md");
    std::fs::write(dir.path().join("data.txt"), "x\n").expect("write data.txt");
    std::fs::create_dir(dir.path().join("sub")).expect("make sub/");
    let page = dir.path().join("sub/page.md");
    let text = "\
# Page: one, two & three!

## Setup (`--flag`)

[good](#page-one-two--three) [good](#setup---flag) [bad](#nope)
[good](../other.md#the-run-command) [good](../other.md#twice-1) [good](../other.md#explicit)
[bad](../other.md#twice-2) [good](../data.txt#L3) [bad](../data.txt#top) [good](../sub/)
[bad](missing.md) ![bad](img/missing.png) [good](/other.md) [good][ref] [bad][undefined]
<https://example.com/x.md> [skipped](https://example.com/missing.md) [skipped](mailto:a@b.c)

[ref]: ../other.md#other-page
";
    let mut report = LinkReport::default();
    check_links(&page, text, dir.path(), &mut HashMap::new(), &mut report);
    assert_eq!(
        report.broken,
        [
            (
                8,
                "[undefined]: no link reference definition `[undefined]: …`"
            ),
            (5, "(#nope): PAGE has no heading or anchor #nope"),
            (
                7,
                "(../other.md#twice-2): OTHER has no heading or anchor #twice-2"
            ),
            (
                7,
                "(../data.txt#top): #top into DATA, which is not Markdown (only a line anchor \
                 like #L10 is)",
            ),
            (8, "(missing.md): SUB/missing.md does not exist"),
            (8, "(img/missing.png): SUB/img/missing.png does not exist"),
        ]
        .map(|(line, want)| {
            let at = |name: &str| shown(&dir.path().join(name));
            format!("{}:{line}: {want}", shown(&page))
                .replace("PAGE", &shown(&page))
                .replace("OTHER", &at("other.md"))
                .replace("DATA", &at("data.txt"))
                .replace("SUB", &at("sub"))
        })
    );
    assert_eq!((report.links, report.anchored), (14, 10), "{report:?}");
}

// ---- proxy-operator flags ----

/// The flags of the binary's `--help`: per subcommand, and the top level's (`--help`,
/// `--version`).
#[derive(Debug, Default)]
struct Help {
    subcommands: BTreeMap<String, BTreeSet<String>>,
    top: BTreeSet<String>,
}

impl Help {
    /// Whether `flag` belongs to `sub`, or with no subcommand to any.
    fn knows(&self, sub: Option<&str>, flag: &str) -> bool {
        match sub {
            Some(sub) => self.subcommands.get(sub).is_some_and(|f| f.contains(flag)),
            None => self.top.contains(flag) || self.subcommands.values().any(|f| f.contains(flag)),
        }
    }
}

/// The long flags a clap `--help` defines: the `--name`s that open an option line.
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter(|line| line.trim_start().starts_with('-'))
        .flat_map(|line| {
            line.split_whitespace()
                .map(|word| word.trim_end_matches(','))
                .take_while(|word| word.starts_with('-'))
                .filter(|word| word.starts_with("--"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The subcommands a clap `--help` lists under `Commands:` (but `help`).
fn help_subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|line| line.trim() != "Commands:")
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter(|line| line.starts_with("  ") && !line.starts_with("   "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

fn run_help(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_proxy-operator"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run proxy-operator {args:?}: {e}"));
    assert!(
        output.status.success(),
        "proxy-operator {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The built binary's flags, from its `--help` and each subcommand's.
fn binary_help() -> Help {
    let top = run_help(&["--help"]);
    let mut help = Help {
        top: help_flags(&top),
        ..Help::default()
    };
    for sub in help_subcommands(&top) {
        let sub_help = run_help(&[&sub, "--help"]);
        // A subcommand of subcommands (`proxies import`) is known by both words.
        for nested in help_subcommands(&sub_help) {
            let flags = help_flags(&run_help(&[&sub, &nested, "--help"]));
            help.subcommands.insert(format!("{sub} {nested}"), flags);
        }
        help.subcommands.insert(sub, help_flags(&sub_help));
    }
    help
}

/// A `proxy-operator` flag the docs name: where, which, and for which subcommand (`None`: a
/// flag on its own, of any subcommand).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mention {
    line: usize,
    flag: String,
    sub: Option<String>,
}

/// A `--flag` word (`--` and a letter), without its `=value`.
fn flag_word(word: &str) -> Option<&str> {
    let rest = word.strip_prefix("--")?;
    rest.starts_with(|c: char| c.is_ascii_alphabetic())
        .then(|| word.split_once('=').map_or(word, |(flag, _)| flag))
}

/// Where a shell command ends and another program's words begin.
fn ends_command(word: &str) -> bool {
    matches!(
        word,
        "|" | "||" | "&&" | ";" | "&" | "--" | ">" | ">>" | "<" | "2>"
    ) || word.starts_with('#')
        || word.starts_with('>')
        || word.starts_with("2>")
}

/// The flags given to `proxy-operator <sub>` on shell command `line` (lines ending in `\`
/// already joined): after a word `proxy-operator` (or a path ending in `/proxy-operator`)
/// directly followed by a subcommand of `subs`, or after `cargo run … -- <sub>`; up to the
/// end of that command. Quotes, commas and brackets around words are dropped, so an exec-form
/// `["proxy-operator", "run", "--x"]` counts too.
fn command_flags(line: &str, subs: &BTreeSet<String>) -> Vec<(String, String)> {
    let words: Vec<&str> = line
        .split_whitespace()
        .map(|w| w.trim_matches(|c| matches!(c, '"' | '\'' | ',' | '[' | ']' | '`')))
        .collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let word = words[i];
        let is_binary = word == "proxy-operator" || word.ends_with("/proxy-operator");
        // `kubectl -n proxy-operator run …` names a namespace, not the binary.
        let is_value = i > 0 && matches!(words[i - 1], "-n" | "--namespace");
        let sub_at = if is_binary && !is_value {
            Some(i + 1)
        } else if word == "cargo" && words.get(i + 1) == Some(&"run") {
            words[i..]
                .iter()
                .take_while(|w| !ends_command(w) || **w == "--")
                .position(|w| *w == "--")
                .map(|at| i + at + 1)
        } else {
            None
        };
        let Some((at, sub)) = sub_at
            .and_then(|at| Some((at, words.get(at)?.to_string())))
            .filter(|(_, sub)| subs.contains(sub))
        else {
            i += 1;
            continue;
        };
        // `proxies import …`: the two words name the subcommand when both do.
        let (last, sub) = match words.get(at + 1).map(|next| format!("{sub} {next}")) {
            Some(nested) if subs.contains(&nested) => (at + 1, nested),
            _ => (at, sub),
        };
        let start = last + 1;
        let end = words[start..]
            .iter()
            .position(|w| ends_command(w))
            .map_or(words.len(), |at| start + at);
        for word in &words[start..end] {
            if let Some(flag) = flag_word(word) {
                found.push((sub.clone(), flag.to_owned()));
            }
        }
        i = end.max(i + 1);
    }
    found
}

/// Every `proxy-operator` flag Markdown `text` names (see the module doc), with its line.
fn flag_mentions(text: &str, subs: &BTreeSet<String>) -> Vec<Mention> {
    let mut mentions = Vec::new();
    let mut block: Option<Vec<(usize, String)>> = None;
    for (event, range) in Parser::new_ext(text, options()).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(_)) => block = Some(Vec::new()),
            Event::Text(t) if block.is_some() => {
                let first = line_of(text, range.start);
                if let Some(lines) = block.as_mut() {
                    lines.extend(
                        t.lines()
                            .enumerate()
                            .map(|(n, line)| (first + n, line.to_owned())),
                    );
                }
            }
            Event::End(TagEnd::CodeBlock) => {
                for (line, command) in joined(block.take().unwrap_or_default()) {
                    mentions.extend(command_flags(&command, subs).into_iter().map(
                        |(sub, flag)| Mention {
                            line,
                            flag,
                            sub: Some(sub),
                        },
                    ));
                }
            }
            Event::Code(span) => {
                let line = line_of(text, range.start);
                let first = span.split_whitespace().next().unwrap_or_default();
                if flag_word(first).is_some() {
                    mentions.extend(span.split_whitespace().filter_map(flag_word).map(|flag| {
                        Mention {
                            line,
                            flag: flag.to_owned(),
                            sub: None,
                        }
                    }));
                } else if first == "proxy-operator"
                    || first.ends_with("/proxy-operator")
                    || first == "cargo"
                {
                    mentions.extend(command_flags(&span, subs).into_iter().map(|(sub, flag)| {
                        Mention {
                            line,
                            flag,
                            sub: Some(sub),
                        }
                    }));
                }
            }
            _ => {}
        }
    }
    mentions
}

/// A code block's lines with each line ending in `\` joined to the next, numbered by the first.
fn joined(lines: Vec<(usize, String)>) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut continues = false;
    for (number, line) in lines {
        let (text, more) = match line.trim_end().strip_suffix('\\') {
            Some(text) => (text.to_owned(), true),
            None => (line, false),
        };
        match out.last_mut() {
            Some((_, last)) if continues => {
                last.push(' ');
                last.push_str(&text);
            }
            _ => out.push((number, text)),
        }
        continues = more;
    }
    out
}

/// `file:line: flag (for sub)` for each mention `help` does not know.
fn unknown_flags(file: &str, mentions: &[Mention], help: &Help) -> Vec<String> {
    mentions
        .iter()
        .filter(|m| !help.knows(m.sub.as_deref(), &m.flag))
        .map(|m| match &m.sub {
            Some(sub) => format!(
                "{file}:{}: {} is not a flag of `proxy-operator {sub}`",
                m.line, m.flag
            ),
            None => format!(
                "{file}:{}: {} is not a flag of any proxy-operator subcommand",
                m.line, m.flag
            ),
        })
        .collect()
}

#[test]
fn every_proxy_operator_flag_the_docs_name_is_in_its_help() {
    let help = binary_help();
    assert!(
        help.subcommands.contains_key("run") && help.subcommands.contains_key("standalone"),
        "subcommands found in --help: {:?}",
        help.subcommands.keys()
    );
    let subs: BTreeSet<String> = help.subcommands.keys().cloned().collect();
    let mut unknown = Vec::new();
    let (mut mentions, mut on_command_lines) = (0, 0);
    for file in doc_files() {
        let found = flag_mentions(&read(&file), &subs);
        mentions += found.len();
        on_command_lines += found.iter().filter(|m| m.sub.is_some()).count();
        unknown.extend(unknown_flags(&shown(&file), &found, &help));
    }
    assert!(
        unknown.is_empty(),
        "{} proxy-operator flags named in the docs are not in `--help`:\n{}",
        unknown.len(),
        unknown.join("\n")
    );
    // An extractor that finds nothing must not pass.
    assert!(
        mentions >= 30 && on_command_lines >= 1,
        "only {mentions} flag mentions ({on_command_lines} on proxy-operator command lines) \
         found: is the extractor broken?"
    );
    eprintln!("docs: {mentions} flag mentions ({on_command_lines} on command lines) are in --help");
}

#[test]
fn the_flag_extractor_checks_proxy_operator_flags_and_ignores_other_programs() {
    let text = "\
Set `--ledger URL`, or `--ledgr-max-size=1GiB`; `kubectl apply --server-side -k x` is kubectl's.

```sh
PROXY_OPERATOR_X=1 /usr/local/bin/proxy-operator run --ledger=x.db \\
  --inventory samples/x.yaml | tee --appendd log
kubectl -n proxy-operator run debug --image=busybox --restart=Never
helm install proxy-operator charts/proxy-operator --namespace proxy-operator --create-namespace
cargo run --release -- standalone --ledger x.db --gc-interval 1m > out  # --not-checked
proxy-operator proxies import l.txt --namespace x --labl a=b | kubectl apply -f - --force
```

`proxy-operator crd --output yaml` and `cargo test --test it` and `--help`.
";
    let subs: BTreeSet<String> = ["run", "standalone", "crd", "proxies", "proxies import"]
        .map(str::to_owned)
        .into();
    let mentions = flag_mentions(text, &subs);
    let said = |line, flag: &str, sub: Option<&str>| Mention {
        line,
        flag: flag.to_owned(),
        sub: sub.map(str::to_owned),
    };
    assert_eq!(
        mentions,
        [
            said(1, "--ledger", None),
            said(1, "--ledgr-max-size", None),
            said(4, "--ledger", Some("run")),
            said(4, "--inventory", Some("run")),
            said(8, "--ledger", Some("standalone")),
            said(8, "--gc-interval", Some("standalone")),
            said(9, "--namespace", Some("proxies import")),
            said(9, "--labl", Some("proxies import")),
            said(12, "--output", Some("crd")),
            said(12, "--help", None),
        ]
    );
    let help = Help {
        subcommands: [
            (
                "run",
                &["--ledger", "--inventory", "--gc-interval", "--help"][..],
            ),
            ("standalone", &["--ledger", "--inventory", "--help"][..]),
            ("crd", &["--help"][..]),
            ("proxies", &["--help"][..]),
            ("proxies import", &["--namespace", "--label", "--help"][..]),
        ]
        .into_iter()
        .map(|(sub, flags)| {
            (
                sub.to_owned(),
                flags.iter().map(|f| (*f).to_owned()).collect(),
            )
        })
        .collect(),
        top: ["--help", "--version"].map(str::to_owned).into(),
    };
    assert_eq!(
        unknown_flags("x.md", &mentions, &help),
        [
            "x.md:1: --ledgr-max-size is not a flag of any proxy-operator subcommand",
            "x.md:8: --gc-interval is not a flag of `proxy-operator standalone`",
            "x.md:9: --labl is not a flag of `proxy-operator proxies import`",
            "x.md:12: --output is not a flag of `proxy-operator crd`",
        ]
    );
}

#[test]
fn the_help_parser_finds_subcommands_and_long_flags() {
    let top = "Usage: proxy-operator <COMMAND>\n\nCommands:\n  standalone  Run without \
               Kubernetes (see `--insecure-no-auth`)\n  run         Run the operator\n  \
               help        Print this message\n\nOptions:\n  -h, --help     Print help\n  \
               -V, --version  Print version\n";
    assert_eq!(help_subcommands(top), ["standalone", "run"]);
    assert_eq!(
        help_flags(top),
        ["--help", "--version"].map(str::to_owned).into()
    );
    let sub = "Options:\n      --ledger <PATH|URL>\n          The lease ledger (not \
               `--ledger-x`)\n\n  -h, --help\n          Print help\n";
    assert_eq!(
        help_flags(sub),
        ["--help", "--ledger"].map(str::to_owned).into()
    );
}

/// Each fenced code block of Markdown `text` with the line it starts on.
fn code_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut block: Option<(usize, String)> = None;
    for (event, range) in Parser::new_ext(text, options()).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(_)) => {
                block = Some((line_of(text, range.start), String::new()))
            }
            Event::Text(t) => {
                if let Some((_, body)) = block.as_mut() {
                    body.push_str(&t);
                }
            }
            Event::End(TagEnd::CodeBlock) => blocks.extend(block.take()),
            _ => {}
        }
    }
    blocks
}

/// The SQL of every `sqlite3 [options] FILE SQL` command that starts a line of shell code
/// `block`, read with shell quoting rules (so a query may span lines inside its quotes).
fn sqlite3_queries(block: &str) -> Vec<String> {
    // A backslash before a newline continues the line, as in a shell.
    let block = block.replace("\\\n", " ");
    let mut queries = Vec::new();
    for (start, _) in block.match_indices("sqlite3 ") {
        let line_start = block[..start].rfind('\n').map_or(0, |i| i + 1);
        let at_command = block[line_start..start].trim().is_empty();
        if !at_command {
            continue;
        }
        let mut words = shlex::Shlex::new(&block[start..]).skip(1);
        let file = words.by_ref().find(|word| !word.starts_with('-'));
        if let (Some(_), Some(sql)) = (file, words.next()) {
            queries.push(sql);
        }
    }
    queries
}

#[test]
fn every_sqlite3_query_in_the_docs_runs_on_a_real_ledger() {
    let ledger =
        crate::support::ledger::Fixture::new(proxy_operator::ledger::LedgerConfig::default());
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in doc_files() {
        for (line, block) in code_blocks(&read(&path)) {
            for sql in sqlite3_queries(&block) {
                checked += 1;
                let output = Command::new("sqlite3")
                    .arg(&ledger.path)
                    .arg(&sql)
                    .output()
                    .expect("the sqlite3 CLI is installed (apt-get install -y sqlite3)");
                if !output.status.success() {
                    failures.push(format!(
                        "{}:{line}: {}\n  {sql}",
                        shown(&path),
                        String::from_utf8_lossy(&output.stderr).trim()
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "queries the ledger refuses:\n{}",
        failures.join("\n")
    );
    assert!(
        checked >= 10,
        "only {checked} sqlite3 queries found in the docs"
    );
}

#[test]
fn the_query_extractor_reads_quoted_multiline_sql() {
    let block = "# a comment naming sqlite3 in passing\nsqlite3 -header -column ledger.db \\\n  \"SELECT a,\n     b FROM t;\"\nsqlite3 ledger.db 'SELECT 1;'\nkubectl cp x:/ledger.db ledger.db\n";
    assert_eq!(
        sqlite3_queries(block),
        vec![
            "SELECT a,\n     b FROM t;".to_owned(),
            "SELECT 1;".to_owned()
        ]
    );
}

//! The house rule of `src/`, checked: modules import each other in one direction. A module may
//! use its parent's items and its children's, but no chain of `use`s and paths (attributes
//! included: a schema transform named in `#[schemars(...)]` is an import too) leads from a
//! module back to itself, so each concept can be read, moved or replaced with what it imports
//! and nothing that imports it. Test code (`#[cfg(test)]`) is not counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// Every module of the tree at `src`, by path (`controllers::proxy::execute::step`; the crate root is
/// `""`), with its file. `tests` modules are test code.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src).unwrap().with_extension("");
            let mut segments: Vec<String> = relative
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if matches!(
                segments.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                segments.pop();
            }
            if segments.last().is_some_and(|s| s == "tests") {
                continue;
            }
            found.insert(segments.join("::"), path);
        }
    }
    found
}

/// The `crate::`/`super::`/`self::` paths one file names outside its test code.
#[derive(Default)]
struct Paths(Vec<Vec<String>>);

/// Whether an item is test code.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
    })
}

fn is_anchor(segment: &str) -> bool {
    matches!(segment, "crate" | "super" | "self")
}

impl Paths {
    fn add(&mut self, segments: Vec<String>) {
        if segments.first().is_some_and(|s| is_anchor(s)) {
            self.0.push(segments);
        }
    }

    /// `a::{b, c::{d}}` as `a::b`, `a::c::d`.
    fn add_use(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.add_use(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut path = prefix.clone();
                path.push(n.ident.to_string());
                self.add(path);
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix.clone();
                path.push(r.ident.to_string());
                self.add(path);
            }
            syn::UseTree::Glob(_) => self.add(prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.add_use(prefix, tree);
                }
            }
        }
    }

    /// Paths inside attribute arguments, as tokens (`transform = super::schema::f`) or as
    /// strings (`deserialize_with = "crate::m::f"`).
    fn add_tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < tokens.len() {
            match &tokens[i] {
                TokenTree::Group(g) => self.add_tokens(g.stream()),
                TokenTree::Literal(l) => {
                    let text = l.to_string();
                    let text = text.trim_matches('"');
                    self.add(text.split("::").map(str::to_owned).collect());
                }
                TokenTree::Ident(ident) if is_anchor(&ident.to_string()) => {
                    let mut path = vec![ident.to_string()];
                    while let [
                        TokenTree::Punct(a),
                        TokenTree::Punct(b),
                        TokenTree::Ident(next),
                        ..,
                    ] = &tokens[i + 1..]
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        path.push(next.to_string());
                        i += 3;
                    }
                    self.add(path);
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Enum(e) => &e.attrs,
            syn::Item::Const(c) => &c.attrs,
            _ => return visit::visit_item(self, item),
        };
        if !is_test(attrs) {
            visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.add_use(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.add(path.segments.iter().map(|s| s.ident.to_string()).collect());
        visit::visit_path(self, path);
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        if let syn::Meta::List(list) = &attr.meta {
            self.add_tokens(list.tokens.clone());
        }
    }
}

/// The module `path` names, seen from module `from`: the longest prefix that is a module.
fn resolve(from: &str, path: &[String], modules: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut base: Vec<&str> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").collect()
    };
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        _ => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
    }
    let mut best = None;
    let mut candidate: Vec<&str> = base;
    for i in 0..=rest.len() {
        if i > 0 {
            candidate.push(&rest[i - 1]);
        }
        let name = candidate.join("::");
        if modules.contains_key(&name) {
            best = Some(name);
        }
    }
    best
}

/// Who imports whom among the modules of `src`: edges between a module and its ancestors or
/// descendants are left out (a child using its parent's items is the normal case).
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap();
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut paths = Paths::default();
        paths.visit_file(&ast);
        let targets = edges.entry(name.clone()).or_default();
        for path in &paths.0 {
            let Some(target) = resolve(name, path, &modules) else {
                continue;
            };
            let related = |a: &str, b: &str| a.is_empty() || b.starts_with(&format!("{a}::"));
            if target != *name && !related(&target, name) && !related(name, &target) {
                targets.insert(target);
            }
        }
    }
    edges
}

/// The import cycles: each strongly connected group of more than one module (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn no_module_of_src_imports_itself_through_others() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = imports(&src);
    assert!(edges.len() > 50, "found only {} modules", edges.len());
    let found = cycles(&edges);
    let report: Vec<String> = found
        .iter()
        .map(|group| {
            let within = |m: &String| {
                edges[m]
                    .iter()
                    .filter(|t| group.contains(t))
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            group
                .iter()
                .map(|m| format!("  {m} -> {}", within(m)))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    assert!(
        found.is_empty(),
        "import cycles in src/ (move what both sides need to a module of its own):\n{}",
        report.join("\n\n")
    );
}

#[test]
fn the_cycle_check_finds_cycles_through_uses_paths_and_attributes() {
    let dir = tempfile::tempdir().unwrap();
    let write = |path: &str, text: &str| {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(
        "lib.rs",
        "pub mod a; pub mod b; pub mod c; pub mod d; pub mod e;",
    );
    // a -> b by a `use` group, b -> a by a path in an attribute.
    write("a.rs", "use crate::{b::{self, B}, c};\npub struct A;");
    write(
        "b.rs",
        "#[serde(with = \"crate::x\")]\n#[schemars(transform = crate::a::f)]\npub struct B;",
    );
    // c -> d by an expression path, d -> c only in test code: no cycle.
    write("c.rs", "pub fn f() { crate::d::g() }");
    write(
        "d.rs",
        "pub fn g() {}\n#[cfg(test)]\nmod tests { use crate::c; }",
    );
    // e/mod.rs and its child use each other: parent and child, no cycle.
    write("e/mod.rs", "mod inner; use self::inner::X; pub struct E;");
    write("e/inner.rs", "use super::E; pub struct X;");
    let edges = imports(dir.path());
    assert_eq!(cycles(&edges), [vec!["a".to_owned(), "b".to_owned()]]);
    assert!(edges["c"].contains("d"));
    assert!(!edges["d"].contains("c"));
}

/// The layers `docs/architecture.md` names in its "Layers" table, top first: the top-level
/// modules of each row (the names in backticks of its second column).
fn layers(doc: &str) -> Vec<Vec<String>> {
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Layers\n"))
        .expect("docs/architecture.md has a \"Layers\" section");
    section
        .lines()
        .filter(|line| {
            line.starts_with("| ") && !line.starts_with("| layer") && !line.starts_with("| ---")
        })
        .map(|row| {
            let modules = row.split('|').nth(2).unwrap_or_default();
            modules
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

/// What breaks the layering: an import from a module to one of a layer above its own or of
/// its own layer (another top-level module), and a top-level module no layer lists.
fn layering_problems(
    edges: &BTreeMap<String, BTreeSet<String>>,
    layers: &[Vec<String>],
) -> Vec<String> {
    let top = |module: &str| module.split("::").next().unwrap_or_default().to_owned();
    let layer_of = |module: &str| layers.iter().position(|l| l.contains(&top(module)));
    let mut problems = Vec::new();
    let unlisted: BTreeSet<String> = edges
        .keys()
        .filter(|m| !m.is_empty() && layer_of(m).is_none())
        .map(|m| top(m))
        .collect();
    for module in unlisted {
        problems.push(format!("{module} is in no layer"));
    }
    for (from, targets) in edges {
        for to in targets {
            if from.is_empty() || top(from) == top(to) {
                continue;
            }
            let (Some(a), Some(b)) = (layer_of(from), layer_of(to)) else {
                continue;
            };
            if a >= b {
                let how = if a == b { "across its layer" } else { "up" };
                problems.push(format!(
                    "{from} -> {to} ({how}: layer {} to {})",
                    a + 1,
                    b + 1
                ));
            }
        }
    }
    problems
}

#[test]
fn every_import_points_down_the_layers_of_the_architecture_page() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let layers = layers(&doc);
    assert!(layers.len() >= 5, "{layers:?}");
    let edges = imports(&root.join("src"));
    let problems = layering_problems(&edges, &layers);
    assert!(
        problems.is_empty(),
        "imports against the layers of docs/architecture.md (move what both sides need to a \
         lower layer):\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_layer_check_finds_imports_up_and_across_and_modules_in_no_layer() {
    let doc = "# A\n\n## Layers\n\n| layer | modules | what |\n| --- | --- | --- |\n\
               | 1 | `top` | |\n| 2 | `left` · `right` | |\n| 3 | `base` | |\n\n## Next\n| 9 | `x` | |\n";
    let layers = layers(doc);
    assert_eq!(layers, [vec!["top"], vec!["left", "right"], vec!["base"]]);
    let edge = |from: &str, to: &[&str]| {
        (
            from.to_owned(),
            to.iter().map(|t| (*t).to_owned()).collect::<BTreeSet<_>>(),
        )
    };
    let edges: BTreeMap<String, BTreeSet<String>> = [
        edge("top", &["left", "base"]),
        edge("left::inner", &["base::types", "right", "top"]),
        edge("right", &["base"]),
        edge("base", &[]),
        edge("stray", &["base"]),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        layering_problems(&edges, &layers),
        [
            "stray is in no layer",
            "left::inner -> right (across its layer: layer 2 to 2)",
            "left::inner -> top (up: layer 2 to 1)",
        ]
    );
}

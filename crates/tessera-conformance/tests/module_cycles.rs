//! No import cycles between the modules of any workspace crate.
//!
//! What is read: every crate's module tree under `crates/*/src`, from `lib.rs` / `main.rs`
//! through `mod NAME;` (the file `NAME.rs` or `NAME/mod.rs`). Inline `mod NAME { .. }` blocks
//! (test modules) belong to their file: their `super` is resolved inside the file, their
//! dependencies count as the file's. Comments and string / char literals are skipped.
//!
//! What counts as a dependency of file module `C` on module `T`:
//! - a path in code or in a private `use` tree that starts with `crate::`, `super::`, `self::`
//!   or the name of a child module of `C`, resolved through the module tree to the deepest
//!   module it names; where it then names an item a module imports (`use` of any visibility:
//!   `crate::SegmentIds` where `lib.rs` has `pub use data::SegmentIds`), it follows that import,
//!   so a dependency lands on the module that defines the item, never on a re-exporting parent.
//! - NOT a `pub use` / `pub(..) use` declaration itself: a module re-exporting its children's
//!   items is not using them.
//!
//! What counts as a cycle: within the scope of each module `S`, the nodes are `S`'s own file and
//! each child subtree of `S`; a dependency `C -> T` whose lowest common module is `S` joins the
//! node holding `C` to the node holding `T` (`S`'s own file when `C` or `T` is `S`). A cycle is
//! a strongly connected set of two or more of those nodes: siblings importing each other
//! (`expr` ⇄ `parse`), or a child using its parent's own items while the parent uses the
//! child's (`backward` ⇄ `backward::bf16`). Each is printed with one `file:line path` per edge.
//!
//! `tessera-mask` and `tessera-attn` must have none. The cycles other crates had when
//! this test was written are listed in [`KNOWN`]: a new one fails, and so does a listed one that
//! has gone (the list only shrinks).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A module path inside one crate (`[]` is the crate root).
type ModPath = Vec<String>;

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Other(char),
}

/// Tokens of `src` with their 1-based line, comments and string / char literals dropped.
fn tokens(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '"' || ((ch == 'r' || ch == 'b') && matches!(at(i + 1), '"' | '#' | 'r')) {
            // A string, byte string or raw string (r"..", r#".."#, br#".."#).
            let mut j = i;
            if c[j] == 'b' {
                j += 1;
            }
            let raw = at(j) == 'r';
            if raw {
                j += 1;
            }
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) != '"' {
                // An identifier starting with r or b.
                let start = i;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
                out.push((Tok::Ident(c[start..i].iter().collect()), line));
                continue;
            }
            j += 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '\n' {
                    line += 1;
                }
                if !raw && c[j] == '\\' {
                    j += 2;
                    continue;
                }
                if c[j] == '"' && (0..hashes).all(|h| at(j + 1 + h) == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
        } else if ch == '\'' {
            // A char literal ('x', '\n', '\''), or a lifetime / label ('a).
            if at(i + 1) == '\\' {
                // Past the quote, the backslash and the escaped character.
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Colons, line));
            i += 2;
        } else {
            out.push((
                match ch {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    ';' => Tok::Semi,
                    '*' => Tok::Star,
                    _ => Tok::Other(ch),
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// One path a file names: where it is written (inline module path, line) and its segments.
#[derive(Debug, Clone)]
struct Use {
    /// The (possibly inline) module the path is written in.
    scope: ModPath,
    line: usize,
    segs: Vec<String>,
    /// `Some(name)`: introduced by a `use` declaration under this name.
    binds: Option<String>,
    /// From a `pub` / `pub(..)` `use` declaration (a re-export: not itself a dependency).
    public: bool,
}

/// Parses a use tree from `t[*i]` under `prefix`, pushing one `(segments, bound name)` per leaf.
fn use_tree(
    t: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut segs = prefix;
    loop {
        match t.get(*i).map(|x| &x.0) {
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                *i += 1;
            }
            Some(Tok::Star) => {
                *i += 1;
                out.push((segs, None));
                return;
            }
            Some(Tok::Open) => {
                *i += 1;
                loop {
                    match t.get(*i).map(|x| &x.0) {
                        Some(Tok::Close) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Comma) => *i += 1,
                        None => return,
                        _ => use_tree(t, i, segs.clone(), out),
                    }
                }
            }
            _ => return,
        }
        if t.get(*i).map(|x| &x.0) == Some(&Tok::Colons) {
            *i += 1;
            continue;
        }
        // End of this leaf: `self` names the prefix; `as NAME` renames.
        let mut name = segs.last().cloned();
        if segs.last().map(String::as_str) == Some("self") {
            segs.pop();
            name = segs.last().cloned();
        }
        if t.get(*i).map(|x| &x.0) == Some(&Tok::Ident("as".into())) {
            name = match t.get(*i + 1).map(|x| &x.0) {
                Some(Tok::Ident(n)) => Some(n.clone()),
                _ => None,
            };
            *i += 2;
        }
        out.push((segs, name.filter(|n| n != "_")));
        return;
    }
}

/// Every `use` leaf and every path in code of one file whose module is `file_mod`; `children`
/// are the file's child modules (paths starting with one of them are relative to the file).
fn paths(src: &str, file_mod: &ModPath, children: &BTreeSet<String>) -> Vec<Use> {
    let t = tokens(src);
    let ident = |i: usize| match t.get(i).map(|x| &x.0) {
        Some(Tok::Ident(s)) => Some(s.as_str()),
        _ => None,
    };
    let is = |i: usize, tok: Tok| t.get(i).map(|x| &x.0) == Some(&tok);
    let mut out = Vec::new();
    // Inline modules open at brace depth `.1`.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        let scope: ModPath = file_mod
            .iter()
            .cloned()
            .chain(inline.iter().map(|m| m.0.clone()))
            .collect();
        match &t[i].0 {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|m| m.1 == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(k) if k == "mod" => {
                if let (Some(name), true) = (ident(i + 1), is(i + 2, Tok::Open)) {
                    inline.push((name.to_string(), depth));
                    depth += 1;
                    i += 3;
                    continue;
                }
            }
            Tok::Ident(k) if k == "use" => {
                // `pub use`, `pub(crate) use`, `pub(in ..) use`: a re-export.
                let public = (i >= 1 && ident(i - 1) == Some("pub"))
                    || (i >= 1 && is(i - 1, Tok::Other(')')) && {
                        let mut j = i - 1;
                        while j > 0 && !is(j, Tok::Other('(')) {
                            j -= 1;
                        }
                        j >= 1 && ident(j - 1) == Some("pub")
                    });
                let line = t[i].1;
                let mut j = i + 1;
                if is(j, Tok::Colons) {
                    j += 1;
                }
                let mut leaves = Vec::new();
                use_tree(&t, &mut j, Vec::new(), &mut leaves);
                for (segs, binds) in leaves {
                    out.push(Use {
                        scope: scope.clone(),
                        line,
                        segs,
                        binds,
                        public,
                    });
                }
                i = j;
                continue;
            }
            Tok::Ident(first) if is(i + 1, Tok::Colons) && (i == 0 || !is(i - 1, Tok::Colons)) => {
                let relative = matches!(first.as_str(), "crate" | "super" | "self")
                    || children.contains(first);
                // `pub(in crate::x)` names a visibility, not a dependency.
                if relative && !(i >= 1 && ident(i - 1) == Some("in")) {
                    let line = t[i].1;
                    let mut segs = vec![first.clone()];
                    let mut j = i + 1;
                    while is(j, Tok::Colons) {
                        match ident(j + 1) {
                            Some(s) => segs.push(s.to_string()),
                            None => break,
                        }
                        j += 2;
                    }
                    out.push(Use {
                        scope,
                        line,
                        segs,
                        binds: None,
                        public: false,
                    });
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// One crate's files: module path -> (file name for messages, source).
type Files = BTreeMap<ModPath, (String, String)>;

/// The module tree from `root` (`lib.rs` or `main.rs`), following `mod NAME;` declarations.
fn crate_files(root: &Path) -> Files {
    let mut files = Files::new();
    let mut todo = vec![(Vec::new(), root.to_path_buf())];
    while let Some((m, file)) = todo.pop() {
        let Ok(src) = fs::read_to_string(&file) else {
            continue;
        };
        let dir = match file.file_name().and_then(|n| n.to_str()) {
            Some("lib.rs" | "main.rs" | "mod.rs") => file.parent().map(Path::to_path_buf),
            _ => file.parent().zip(file.file_stem()).map(|(p, s)| p.join(s)),
        }
        .unwrap_or_default();
        for name in declared_children(&src) {
            let mut child = m.clone();
            child.push(name.clone());
            let flat = dir.join(format!("{name}.rs"));
            let nested = dir.join(&name).join("mod.rs");
            todo.push((child, if flat.exists() { flat } else { nested }));
        }
        // Shown from the `crates/` folder on (`tessera-mask/src/expr.rs`).
        let base = root.ancestors().nth(3).unwrap_or(Path::new(""));
        let shown = file
            .strip_prefix(base)
            .unwrap_or(&file)
            .display()
            .to_string();
        files.insert(m, (shown, src));
    }
    files
}

/// The names of `mod NAME;` declarations (file modules) of a source.
fn declared_children(src: &str) -> BTreeSet<String> {
    let t = tokens(src);
    t.windows(3)
        .filter_map(|w| match (&w[0].0, &w[1].0, &w[2].0) {
            (Tok::Ident(k), Tok::Ident(n), Tok::Semi) if k == "mod" => Some(n.clone()),
            _ => None,
        })
        .collect()
}

/// An edge of the dependency graph with its evidence.
#[derive(Debug, Clone)]
struct Dep {
    from: ModPath,
    to: ModPath,
    at: String,
}

/// Resolves `segs` written in `scope` to the module defining what it names.
fn resolve(
    files: &Files,
    imports: &BTreeMap<ModPath, Vec<Use>>,
    scope: &ModPath,
    segs: &[String],
    budget: usize,
) -> Option<ModPath> {
    if budget == 0 {
        return None;
    }
    let mut cur = scope.clone();
    let mut rest = segs;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            cur.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        _ => {}
    }
    while rest.first().map(String::as_str) == Some("super") {
        cur.pop()?;
        rest = &rest[1..];
    }
    // Out of inline modules: resolution continues in the enclosing file module.
    while !files.contains_key(&cur) {
        cur.pop()?;
    }
    while let Some(seg) = rest.first() {
        let mut child = cur.clone();
        child.push(seg.clone());
        if files.contains_key(&child) {
            cur = child;
            rest = &rest[1..];
            continue;
        }
        // An item `cur` imports: follow the import to where the item is defined.
        let via = imports.get(&cur).and_then(|us| {
            us.iter()
                .find(|u| u.scope == cur && u.binds.as_deref() == Some(seg.as_str()))
        });
        if let Some(u) = via {
            let mut target = u.segs.clone();
            target.extend(rest[1..].iter().cloned());
            return resolve(files, imports, &u.scope, &target, budget - 1).or(Some(cur));
        }
        break;
    }
    Some(cur)
}

/// The dependencies between the file modules of one crate (self-dependencies dropped).
fn deps(files: &Files) -> Vec<Dep> {
    let mut all: BTreeMap<ModPath, Vec<Use>> = BTreeMap::new();
    for (m, (_, src)) in files {
        let children: BTreeSet<String> = files
            .keys()
            .filter(|k| k.len() == m.len() + 1 && k.starts_with(m))
            .filter_map(|k| k.last().cloned())
            .collect();
        all.insert(m.clone(), paths(src, m, &children));
    }
    // Only paths that may lead into this crate: external `use` (std, other crates) resolve to
    // the importing module itself and are dropped below as self-dependencies.
    let mut out = Vec::new();
    for (m, uses) in &all {
        let children: BTreeSet<&String> = files
            .keys()
            .filter(|k| k.len() == m.len() + 1 && k.starts_with(m))
            .filter_map(|k| k.last())
            .collect();
        for u in uses {
            if u.public {
                continue;
            }
            let first = u.segs.first().map(String::as_str).unwrap_or("");
            let local =
                matches!(first, "crate" | "super" | "self") || children.contains(&u.segs[0]);
            if !local {
                continue;
            }
            let Some(to) = resolve(files, &all, &u.scope, &u.segs, 16) else {
                continue;
            };
            if &to != m {
                out.push(Dep {
                    from: m.clone(),
                    to,
                    at: format!("{}:{} {}", files[m].0, u.line, u.segs.join("::")),
                });
            }
        }
    }
    out
}

fn show(m: &[String]) -> String {
    std::iter::once("crate")
        .chain(m.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

/// A set of module nodes that import each other (a strongly connected set, see the file doc).
#[derive(Debug)]
struct Cycle {
    /// The nodes, sorted: the stable name of the cycle.
    nodes: Vec<String>,
    /// One concrete cycle through the first node, then every edge inside the set with where it
    /// is written.
    text: String,
}

/// Every cycle of one crate's modules (see the file doc).
fn cycles(files: &Files) -> Vec<Cycle> {
    // Per scope: node name -> (node name -> evidence).
    type Graph = BTreeMap<String, BTreeMap<String, String>>;
    let mut graphs: BTreeMap<ModPath, Graph> = BTreeMap::new();
    for d in deps(files) {
        let common = d.from.iter().zip(&d.to).take_while(|(a, b)| a == b).count();
        let scope: ModPath = d.from[..common].to_vec();
        let node = |m: &ModPath| {
            if m.len() == common {
                format!("{} (own items)", show(&scope))
            } else {
                show(&m[..=common])
            }
        };
        let (a, b) = (node(&d.from), node(&d.to));
        graphs
            .entry(scope)
            .or_default()
            .entry(a)
            .or_default()
            .entry(b)
            .or_insert(d.at);
    }
    let mut found = Vec::new();
    for g in graphs.values() {
        let edges = |x: &String| g.get(x).into_iter().flat_map(|e| e.keys());
        let reach = |from: &String| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from.clone()];
            while let Some(x) = todo.pop() {
                for y in edges(&x) {
                    if seen.insert(y.clone()) {
                        todo.push(y.clone());
                    }
                }
            }
            seen
        };
        let reached: BTreeMap<&String, BTreeSet<String>> =
            g.keys().map(|n| (n, reach(n))).collect();
        let mut done = BTreeSet::new();
        for (n, from_n) in &reached {
            if done.contains(*n) || !from_n.contains(*n) {
                continue;
            }
            let nodes: Vec<String> = from_n
                .iter()
                .filter(|m| reached.get(m).is_some_and(|r| r.contains(*n)))
                .cloned()
                .collect();
            done.extend(nodes.iter().cloned());
            // The shortest cycle through `n` (breadth first back to it).
            let mut prev: BTreeMap<String, String> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([(*n).clone()]);
            'bfs: while let Some(x) = queue.pop_front() {
                for y in edges(&x) {
                    if !prev.contains_key(y) {
                        prev.insert(y.clone(), x.clone());
                        if y == *n {
                            break 'bfs;
                        }
                        queue.push_back(y.clone());
                    }
                }
            }
            let mut path = vec![(*n).clone()];
            let mut cur = prev[*n].clone();
            while &cur != *n {
                path.push(cur.clone());
                cur = prev[&cur].clone();
            }
            path.push((*n).clone());
            path.reverse();
            let mut text = path.join(" -> ");
            for a in &nodes {
                for (b, at) in g.get(a).into_iter().flatten() {
                    if nodes.contains(b) {
                        text += &format!("\n  {a} -> {b}: {at}");
                    }
                }
            }
            found.push(Cycle { nodes, text });
        }
    }
    found
}

fn workspace_crates() -> Vec<(String, PathBuf)> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for entry in fs::read_dir(&crates)
        .expect("crates/ is readable")
        .flatten()
    {
        for root in ["src/lib.rs", "src/main.rs"] {
            let p = entry.path().join(root);
            if p.exists() {
                out.push((entry.file_name().to_string_lossy().into_owned(), p));
            }
        }
    }
    out.sort();
    out
}

/// Cycles that were in the workspace when this test was written, outside the crates this test
/// names (crate, sorted nodes of the cycle). A new cycle anywhere fails the test; so does a
/// listed one that is gone (remove it here), so the list only shrinks.
const KNOWN: &[(&str, &[&str])] = &[
    ("tessera-core", &["crate::budget", "crate::error"]),
    (
        "tessera-export",
        &["crate (own items)", "crate::flex", "crate::splash"],
    ),
    (
        "tessera-io",
        &["crate (own items)", "crate::npy", "crate::sfts"],
    ),
    (
        "tessera-pack",
        &[
            "crate (own items)",
            "crate::input",
            "crate::place",
            "crate::verify",
        ],
    ),
];

/// Crates that must have no cycle at all, whatever `KNOWN` says.
const ACYCLIC: &[&str] = &["tessera-mask", "tessera-attn"];

#[test]
fn no_module_cycles_in_workspace() {
    let crates = workspace_crates();
    let names: Vec<&str> = crates.iter().map(|c| c.0.as_str()).collect();
    for required in ACYCLIC {
        assert!(
            names.contains(required),
            "{required} not found among {names:?}"
        );
    }
    let (mut new, mut seen) = (Vec::new(), BTreeSet::new());
    for (name, root) in &crates {
        let files = crate_files(root);
        assert!(
            files.contains_key(&Vec::new()),
            "{name}: {} unread",
            root.display()
        );
        // The walk reaches the modules the issue names (a tree of one file would hide cycles).
        if ACYCLIC.contains(&name.as_str()) {
            assert!(files.len() > 4, "{name}: only {:?} read", files.keys());
        }
        for c in cycles(&files) {
            let known = !ACYCLIC.contains(&name.as_str())
                && KNOWN
                    .iter()
                    .any(|(k, nodes)| k == name && nodes.iter().eq(c.nodes.iter()));
            if known {
                seen.insert((name.clone(), c.nodes.clone()));
            } else {
                new.push(format!("{name}: {}", c.text));
            }
        }
    }
    assert!(new.is_empty(), "module import cycles:\n{}", new.join("\n"));
    for (k, nodes) in KNOWN {
        let key = (
            k.to_string(),
            nodes.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
        );
        assert!(
            seen.contains(&key),
            "{k}: the known cycle {nodes:?} is gone: remove it from KNOWN"
        );
    }
}

/// A synthetic crate from `(module path, source)` pairs.
fn synthetic(mods: &[(&str, &str)]) -> Files {
    mods.iter()
        .map(|(m, src)| {
            let path: ModPath = m
                .split("::")
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            (path, (format!("{m}.rs"), src.to_string()))
        })
        .collect()
}

#[test]
fn sibling_cycle_is_found_and_printed() {
    // The shape tessera-mask had: expr uses parse's helper, parse builds expr's type.
    let files = synthetic(&[
        ("", "mod expr; mod parse;\npub use expr::Mask;\npub use parse::parse;"),
        ("expr", "use crate::parse::dense_arg;\npub struct Mask;"),
        ("parse", "// use crate::nothing;\nuse crate::expr::Mask;\npub fn parse() {}\npub(crate) fn dense_arg() {}"),
    ]);
    let c = cycles(&files);
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(c[0].nodes, ["crate::expr", "crate::parse"]);
    assert!(
        c[0].text
            .starts_with("crate::expr -> crate::parse -> crate::expr"),
        "{}",
        c[0].text
    );
    assert!(
        c[0].text.contains("expr.rs:1 crate::parse::dense_arg"),
        "{}",
        c[0].text
    );
    assert!(
        c[0].text.contains("parse.rs:2 crate::expr::Mask"),
        "{}",
        c[0].text
    );
}

#[test]
fn parent_child_cycle_is_found() {
    // The shape of tessera-attn's backward: the child reaches its parent's own items (also from
    // a code path and a test module), the parent calls the child.
    let files = synthetic(&[
        ("", "mod backward;"),
        (
            "backward",
            "mod bf16;\nfn run() { bf16::entry() }\nfn helper() {}",
        ),
        ("backward::bf16", "pub fn entry() { super::helper() }"),
    ]);
    assert_eq!(cycles(&files).len(), 1);
    let test_mod = synthetic(&[
        ("", "mod backward;"),
        ("backward", "mod bf16;\nmod tiles;\nfn run() { bf16::entry() }"),
        ("backward::tiles", "pub fn helper() {}"),
        ("backward::bf16", "use super::tiles::helper;\npub fn entry() {}\nmod tests { use super::*; fn t() { super::super::run() } }"),
    ]);
    let c = cycles(&test_mod);
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(
        c[0].nodes,
        ["crate::backward (own items)", "crate::backward::bf16"]
    );
}

#[test]
fn re_exports_and_one_way_imports_are_not_cycles() {
    // The root re-exports every child; children name each other's items through the root's
    // re-exports (resolved to the defining module), strings and comments mention `crate::`.
    let files = synthetic(&[
        ("", "mod a; mod b; mod c;\npub use a::A;\npub use b::{B, helper as h};\npub use c::C;"),
        ("a", "/* use crate::c::C; */ pub struct A;\nconst S: &str = \"crate::c::C\";\nconst Q: char = '\"';"),
        ("b", "use crate::A;\npub struct B;\npub fn helper() {}"),
        ("c", "use crate::{h, B};\nfn f() { let _ = crate::A; }\npub struct C;"),
    ]);
    let c = cycles(&files);
    assert!(c.is_empty(), "{c:?}");
    let d = deps(&files);
    let edge = |from: &str, to: &str| d.iter().any(|e| show(&e.from) == from && show(&e.to) == to);
    assert!(
        edge("crate::b", "crate::a")
            && edge("crate::c", "crate::b")
            && edge("crate::c", "crate::a"),
        "{d:?}"
    );
    assert!(
        !d.iter().any(|e| e.from.is_empty()),
        "re-exports counted: {d:?}"
    );
}

//! DESIGN.md: "No module imports a module that imports it back." This test
//! reads the crate's sources, takes every path a module names — `use`
//! trees and inline `crate::a::b` paths, test modules included — as an edge
//! to the file module that holds it, and fails on a cycle.
//!
//! It reads paths, not types: an inherent method called on a type defined
//! elsewhere adds no edge. It is a text scan, not a parser: comments are
//! stripped by line, and a `mod tests` block is recognised by its
//! `#[cfg(test)]` header at the end of a file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Module path ("" for the crate root, "codec::record") of every source file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
                parts.pop();
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Flattens a `use` tree (`a::{b, c::{d, self}}`) into full paths.
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{').filter(|_| tree.ends_with('}')) else {
        return vec![tree];
    };
    let prefix = &tree[..open];
    let body = &tree[open + 1..tree.len() - 1];
    let mut items = Vec::new();
    let (mut depth, mut cur) = (0, String::new());
    for c in body.chars() {
        match c {
            ',' if depth == 0 => items.push(std::mem::take(&mut cur)),
            _ => {
                depth += i32::from(c == '{') - i32::from(c == '}');
                cur.push(c);
            }
        }
    }
    if !cur.is_empty() {
        items.push(cur);
    }
    items
        .iter()
        .flat_map(|item| expand_use(item))
        .map(|p| match p.as_str() {
            "self" => prefix.trim_end_matches(':').to_string(),
            _ => format!("{prefix}{p}"),
        })
        .collect()
}

/// The `use` trees in `text` (everything between `use` and `;`).
fn use_trees(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at + 4..];
        if before.is_some_and(is_ident) {
            rest = tail;
            continue;
        }
        let end = tail.find(';').unwrap_or(tail.len());
        let tree = tail[..end].trim();
        // Prose in a string literal ("in use by ...") is not a path.
        let path_chars = |c: char| is_ident(c) || ":{},* \n".contains(c);
        if tree.chars().all(path_chars) {
            out.push(tree);
        }
        rest = &tail[end..];
    }
    out
}

/// Inline paths that start at the crate root (`crate::a::b`).
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        if text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| is_ident(c) || c == ':')
        {
            continue;
        }
        let path: String = text[at..]
            .chars()
            .take_while(|&c| is_ident(c) || c == ':')
            .collect();
        out.push(path);
    }
    out
}

struct Crate {
    modules: BTreeMap<String, PathBuf>,
    /// Names the crate root re-exports, and the module each comes from.
    root_reexports: BTreeMap<String, String>,
}

impl Crate {
    /// The file module that holds the item at `path` (from the crate root).
    fn owner(&self, path: &str) -> Option<String> {
        let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
        let first = *parts.first()?;
        if !self.modules.contains_key(first) {
            return self.root_reexports.get(first).cloned();
        }
        (1..=parts.len())
            .rev()
            .map(|n| parts[..n].join("::"))
            .find(|m| self.modules.contains_key(m))
    }

    fn join(base: &str, rest: &str) -> String {
        match base {
            "" => rest.to_string(),
            _ => format!("{base}::{rest}"),
        }
    }

    /// Edges from module `module` whose (comment-free) source is `text`.
    fn edges(&self, module: &str, text: &str) -> BTreeSet<String> {
        let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
        // In a `mod tests` block, `super` is the file's own module.
        let split = text
            .match_indices("#[cfg(test)]")
            .map(|(at, _)| at)
            .find(|&at| {
                let after = text[at + "#[cfg(test)]".len()..].trim_start();
                after.starts_with("mod tests") || after.starts_with("pub(crate) mod tests")
            })
            .unwrap_or(text.len());
        let mut out = BTreeSet::new();
        for (part, super_base) in [(&text[..split], parent), (&text[split..], module)] {
            let mut paths: Vec<String> = use_trees(part).into_iter().flat_map(expand_use).collect();
            paths.extend(crate_paths(part));
            for path in paths {
                let from_root = if let Some(rest) = path.strip_prefix("crate::") {
                    rest.to_string()
                } else if let Some(rest) = path.strip_prefix("super::") {
                    Self::join(super_base, rest)
                } else if let Some(rest) = path.strip_prefix("self::") {
                    Self::join(module, rest)
                } else {
                    // A child module named relative to this one (`mod x;
                    // pub use x::Y;`); anything else is another crate.
                    let first = path.split("::").next().unwrap_or("");
                    let child = Self::join(module, first);
                    if module.is_empty() || !self.modules.contains_key(&child) {
                        continue;
                    }
                    Self::join(module, &path)
                };
                if let Some(target) = self.owner(&from_root) {
                    if target != module {
                        out.insert(target);
                    }
                }
            }
        }
        out
    }
}

/// Some cycle of `graph`, if it has one (depth-first, with colours).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Colour {
        White,
        Grey,
        Black,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        colour: &mut BTreeMap<String, Colour>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        colour.insert(node.to_string(), Colour::Grey);
        stack.push(node.to_string());
        for next in &graph[node] {
            match colour[next] {
                Colour::Grey => {
                    let at = stack.iter().position(|n| n == next).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Colour::White => {
                    if let Some(cycle) = visit(next, graph, colour, stack) {
                        return Some(cycle);
                    }
                }
                Colour::Black => {}
            }
        }
        stack.pop();
        colour.insert(node.to_string(), Colour::Black);
        None
    }
    let mut colour: BTreeMap<String, Colour> =
        graph.keys().map(|k| (k.clone(), Colour::White)).collect();
    for node in graph.keys() {
        if colour[node] == Colour::White {
            if let Some(cycle) = visit(node, graph, &mut colour, &mut Vec::new()) {
                return Some(cycle);
            }
        }
    }
    None
}

fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src);
    let root = strip_comments(&fs::read_to_string(&modules[""]).unwrap());
    let mut root_reexports = BTreeMap::new();
    for tree in use_trees(&root) {
        let tree = tree.trim_start_matches("pub ").trim();
        for path in expand_use(tree) {
            if let Some((module, name)) = path.split_once("::") {
                let name = name.rsplit("::").next().unwrap_or(name);
                root_reexports.insert(name.to_string(), module.to_string());
            }
        }
    }
    let krate = Crate {
        modules,
        root_reexports,
    };
    krate
        .modules
        .iter()
        .filter(|(module, _)| !module.is_empty())
        .map(|(module, path)| {
            let text = strip_comments(&fs::read_to_string(path).unwrap());
            (module.clone(), krate.edges(module, &text))
        })
        .collect()
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    let listing: String = graph
        .iter()
        .map(|(m, to)| {
            format!(
                "{m} -> {}\n",
                to.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle: {}\n{listing}", cycle.join(" -> "));
    }
    // The scan must see the edges it is meant to police.
    assert!(graph["volume"].contains("file"), "{listing}");
    assert!(graph["file"].contains("mount_state"), "{listing}");
    assert!(graph["codec"].contains("codec::record"), "{listing}");
    assert!(
        graph["codec::record"].contains("codec::primitive"),
        "{listing}"
    );
}

#[test]
fn the_scan_finds_a_cycle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.insert("a".into(), ["b".to_string()].into());
    graph.insert("b".into(), ["c".to_string()].into());
    graph.insert("c".into(), ["a".to_string()].into());
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    graph.get_mut("c").unwrap().clear();
    assert_eq!(find_cycle(&graph), None);
    assert_eq!(
        expand_use("crate::a::{b, c::{d, self}}"),
        ["crate::a::b", "crate::a::c::d", "crate::a::c"]
    );
}

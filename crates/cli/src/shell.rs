//! Splitting a command string into words the way a POSIX shell would:
//! whitespace separates words, `'...'` is literal, `"..."` allows `\"`, `\\`,
//! `\$` and `` \` `` escapes, and a backslash outside quotes escapes the next
//! character. No expansion of any kind is done.

/// Splits `line` into words. Fails on an unterminated quote or a trailing
/// backslash.
pub fn split(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err("unterminated single quote".to_string()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => word.push(c),
                            Some('\n') => {}
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => return Err("unterminated double quote".to_string()),
                        },
                        Some(c) => word.push(c),
                        None => return Err("unterminated double quote".to_string()),
                    }
                }
            }
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(c) => {
                    in_word = true;
                    word.push(c);
                }
                None => return Err("trailing backslash".to_string()),
            },
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::split;

    fn s(line: &str) -> Vec<String> {
        split(line).unwrap()
    }

    #[test]
    fn words_and_quotes() {
        assert_eq!(
            s("pwrite -S 0xab 0 4k"),
            ["pwrite", "-S", "0xab", "0", "4k"]
        );
        assert_eq!(s("  open   -c  /a  "), ["open", "-c", "/a"]);
        assert_eq!(s("open '/a b'"), ["open", "/a b"]);
        assert_eq!(s(r#"open "/a \"b\" \\ c""#), ["open", r#"/a "b" \ c"#]);
        assert_eq!(s(r"open /a\ b"), ["open", "/a b"]);
        assert_eq!(s("mv ''  /x"), ["mv", "", "/x"]);
        assert_eq!(s("x'y'\"z\""), ["xyz"]);
        assert!(s("").is_empty());
        assert!(s("   ").is_empty());
    }

    #[test]
    fn errors() {
        assert!(split("open 'a").is_err());
        assert!(split("open \"a").is_err());
        assert!(split("open a\\").is_err());
    }
}

//! A small `--flag value` / `--flag=value` parser with errors that name the flag.

use std::collections::HashMap;
use std::str::FromStr;

use mooncake_base::util::{size, switch};

/// A parsed command line: each flag's value, and which flags the command asked for
/// (the rest are reported as unknown).
pub struct Args {
    values: HashMap<String, String>,
    used: std::cell::RefCell<Vec<String>>,
    /// The last argument, a flag with no value after it: an error either way, but
    /// which one ("needs a value" or "unknown") only the command can tell.
    dangling: Option<String>,
}

/// Flags that take no value.
pub const SWITCHES: &[&str] = &[
    "json",
    "help",
    "until-stdin-eof",
    "no-verify",
    "draft",
    "list",
    "control",
    "enable-ha",
    "enable-http-metadata-server",
];

impl Args {
    /// Parses `--flag value`, `--flag=value` and the [`SWITCHES`].
    pub fn parse(raw: &[String]) -> Result<Args, String> {
        Args::parse_with_aliases(raw, &[])
    }

    /// As `parse`, renaming `(alias, canonical)` flags (after `_` → `-`).
    pub fn parse_with_aliases(raw: &[String], aliases: &[(&str, &str)]) -> Result<Args, String> {
        let mut values = HashMap::new();
        let mut dangling = None;
        let mut it = raw.iter();
        let canonical = |k: &str| {
            let k = k.replace('_', "-");
            aliases
                .iter()
                .find(|(a, _)| *a == k)
                .map_or(k, |(_, c)| (*c).to_owned())
        };
        while let Some(a) = it.next() {
            if let Some(flag) = a.strip_prefix("--") {
                let (k, v) = match flag.split_once('=') {
                    Some((k, v)) => (k.to_owned(), v.to_owned()),
                    None if SWITCHES.contains(&flag) => (flag.to_owned(), "true".to_owned()),
                    None => match it.next() {
                        Some(v) => (flag.to_owned(), v.clone()),
                        None => {
                            dangling = Some(canonical(flag));
                            break;
                        }
                    },
                };
                values.insert(canonical(&k), v);
            } else {
                return Err(format!("unexpected argument {a:?}"));
            }
        }
        Ok(Args {
            values,
            used: Default::default(),
            dangling,
        })
    }

    /// The raw value of `--key`, if given (marks the flag as known).
    pub fn str(&self, key: &str) -> Option<&str> {
        self.used.borrow_mut().push(key.to_owned());
        self.values.get(key).map(String::as_str)
    }

    /// The value of `key`, or `Err` when it was given without one (the last argument).
    fn value(&self, key: &str) -> Result<Option<&str>, String> {
        if self.dangling.as_deref() == Some(key) {
            return Err(format!("--{key} needs a value"));
        }
        Ok(self.str(key))
    }

    /// The on/off setting `--key`: `None` when not given, else its value in one of
    /// [`switch::parse`]'s spellings (a bare [`SWITCHES`] flag is on); anything else
    /// is an error, so a misspelt "off" never turns a setting on.
    pub fn switch(&self, key: &str) -> Result<Option<bool>, String> {
        match self.value(key)? {
            None => Ok(None),
            Some(v) => switch::parse(v)
                .map(Some)
                .ok_or_else(|| format!("--{key}: {v:?} is not true or false")),
        }
    }

    /// Whether the switch `--key` is on (off when not given).
    pub fn flag(&self, key: &str) -> Result<bool, String> {
        Ok(self.switch(key)?.unwrap_or(false))
    }

    /// The value of `--key` parsed as `T`, or `default` when not given.
    pub fn get<T: FromStr>(&self, key: &str, default: T) -> Result<T, String> {
        match self.value(key)? {
            None => Ok(default),
            Some(v) => parse_value(v).ok_or_else(|| {
                let what = std::any::type_name::<T>();
                match what.strip_prefix('u').and_then(|b| b.parse::<u32>().ok()) {
                    // Unsigned integers: say the range, not just "cannot parse".
                    Some(bits) if v.parse::<u128>().is_ok() => format!(
                        "--{key}: {v} is out of range (at most {})",
                        u128::MAX >> (128 - bits)
                    ),
                    _ => format!("--{key}: cannot parse {v:?}"),
                }
            }),
        }
    }

    /// Fails on flags nobody asked for (typos should not be silently ignored).
    pub fn finish(&self) -> Result<(), String> {
        let used = self.used.borrow();
        if let Some(key) = &self.dangling {
            return Err(match used.contains(key) {
                true => format!("--{key} needs a value"),
                false => format!("unknown option --{key} (and no value after it)"),
            });
        }
        let mut unknown: Vec<_> = self
            .values
            .keys()
            .filter(|k| !used.contains(k))
            .cloned()
            .collect();
        unknown.sort();
        match unknown.is_empty() {
            true => Ok(()),
            false => Err(format!("unknown option(s): --{}", unknown.join(", --"))),
        }
    }
}

/// Numbers may carry a binary size suffix: 4K, 1M, 2G (also KiB/MiB/GiB).
fn parse_value<T: FromStr>(v: &str) -> Option<T> {
    v.parse()
        .ok()
        .or_else(|| size::parse(v).ok()?.to_string().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_flags() {
        let raw: Vec<String> = ["--size", "4M", "--name=x", "--json"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a = Args::parse(&raw).unwrap();
        assert_eq!(a.get::<u64>("size", 0).unwrap(), 4 << 20);
        assert_eq!(a.str("name"), Some("x"));
        assert_eq!(a.flag("json"), Ok(true));
        assert_eq!(a.flag("list"), Ok(false));
        a.finish().unwrap();
        // On/off values: one spelling everywhere, and nothing else.
        let raw: Vec<String> = ["--json=off", "--a", "On", "--b", "0", "--c", "no"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a = Args::parse(&raw).unwrap();
        assert_eq!(a.flag("json"), Ok(false));
        assert_eq!(a.switch("a"), Ok(Some(true)));
        assert_eq!(a.switch("b"), Ok(Some(false)));
        assert_eq!(a.switch("d"), Ok(None));
        assert_eq!(
            a.switch("c").unwrap_err(),
            r#"--c: "no" is not true or false"#
        );
        // A last flag with no value: "needs a value" if the command knows it, else
        // unknown.
        let a = Args::parse(&["--size".to_string()]).unwrap();
        assert_eq!(a.get::<u64>("size", 0).unwrap_err(), "--size needs a value");
        let a = Args::parse(&["--bogus".to_string()]).unwrap();
        assert!(a
            .finish()
            .unwrap_err()
            .starts_with("unknown option --bogus"));
        let a = Args::parse(&["--port".to_string(), "99999".to_string()]).unwrap();
        assert_eq!(
            a.get::<u16>("port", 0).unwrap_err(),
            "--port: 99999 is out of range (at most 65535)"
        );
        assert_eq!(parse_value::<u64>("1GiB"), Some(1 << 30));
        assert_eq!(parse_value::<u64>("x"), None);
    }
}

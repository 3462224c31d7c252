//! A request's query string, read strictly: each endpoint names the
//! parameters it takes, and anything else (an unknown name, a name given
//! twice, a value out of range) is refused with a line saying why, for
//! the 400 answer.

use std::{collections::BTreeMap, time::Duration};

use crate::report::options::{Choice, Format, SortKey, Weight};

/// The longest window `?seconds=N` may ask for: the request stays open
/// that long, holding one of the server's connections.
pub const MAX_WINDOW: Duration = Duration::from_secs(90);

/// The parameters of one request, decoded, by name.
#[derive(Debug, Default)]
pub struct Params {
    values: BTreeMap<String, String>,
}

impl Params {
    /// Parses `query`, refusing any parameter not in `accepted`.
    pub fn parse(query: Option<&str>, accepted: &[&str]) -> Result<Self, String> {
        let mut values = BTreeMap::new();
        for pair in query.unwrap_or_default().split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let (name, value) = (decode(name)?, decode(value)?);
            if !accepted.contains(&name.as_str()) {
                return Err(if accepted.is_empty() {
                    "this endpoint takes no query parameters".to_owned()
                } else {
                    format!("unknown parameter {name:?}: this endpoint takes {}", accepted.join(", "))
                });
            }
            if values.insert(name.clone(), value).is_some() {
                return Err(format!("parameter {name:?} is given twice"));
            }
        }
        Ok(Self { values })
    }

    /// A number parameter in `range`, or `None` when absent.
    pub fn number(&self, name: &str, range: std::ops::RangeInclusive<u64>) -> Result<Option<u64>, String> {
        let Some(value) = self.values.get(name) else { return Ok(None) };
        match value.parse::<u64>() {
            Ok(number) if range.contains(&number) => Ok(Some(number)),
            _ => Err(format!(
                "{name}={value:?} is not a whole number from {} to {}",
                range.start(),
                range.end()
            )),
        }
    }

    /// A named choice, or `default` when absent.
    pub fn choice<C: Choice>(&self, name: &str, default: C) -> Result<C, String> {
        let Some(value) = self.values.get(name) else { return Ok(default) };
        C::ALL.iter().copied().find(|choice| choice.name() == value).ok_or_else(|| {
            let names: Vec<&str> = C::ALL.iter().map(|choice| choice.name()).collect();
            format!("{name}={value:?} is not one of {}", names.join(", "))
        })
    }

    /// The process a report is asked for.
    pub fn pid(&self) -> Result<u32, String> {
        let pid = self.pid_if_given()?;
        pid.ok_or_else(|| "which process? add ?pid=PID; /api/v1/targets lists those followed".to_owned())
    }

    /// The process a report is asked for, if one is.
    pub fn pid_if_given(&self) -> Result<Option<u32>, String> {
        let pid = self.number("pid", 1..=u64::from(u32::MAX))?;
        pid.map(|pid| u32::try_from(pid).map_err(|_| format!("pid={pid} is not a pid"))).transpose()
    }

    /// `?seconds=N`: the window a report covers, if one is asked for.
    pub fn window(&self) -> Result<Option<Duration>, String> {
        Ok(self.number("seconds", 1..=MAX_WINDOW.as_secs())?.map(Duration::from_secs))
    }
}

/// What `/api/v1/report` is asked for, with the CLI's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReportAsked {
    pub format: Format,
    pub weight: Weight,
    pub sort: SortKey,
    pub top: usize,
    /// `older=MS`: only allocations at least this old, as `-o`.
    pub older_ms: Option<u64>,
}

impl ReportAsked {
    pub const PARAMETERS: &[&str] = &["pid", "format", "weight", "sort", "top", "older", "seconds"];

    pub fn of(params: &Params) -> Result<Self, String> {
        let top = params.number("top", 1..=u64::from(u32::MAX))?.unwrap_or(10);
        Ok(Self {
            format: params.choice("format", Format::Text)?,
            weight: params.choice("weight", Weight::Bytes)?,
            sort: params.choice("sort", SortKey::Size)?,
            top: usize::try_from(top).unwrap_or(usize::MAX),
            older_ms: params.number("older", 0..=u64::MAX / 1_000_000)?,
        })
    }
}

/// `%XX` escapes decoded, and `+` read as a space as forms write it; the
/// result must be UTF-8.
fn decode(text: &str) -> Result<String, String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, after)) = rest.split_first() {
        rest = after;
        match byte {
            b'+' => bytes.push(b' '),
            b'%' => {
                let escaped = rest.get(..2).and_then(|hex| std::str::from_utf8(hex).ok());
                let value = escaped.and_then(|hex| u8::from_str_radix(hex, 16).ok());
                bytes.push(value.ok_or_else(|| format!("{text:?} has a broken %-escape"))?);
                rest = &rest[2..];
            }
            other => bytes.push(other),
        }
    }
    String::from_utf8(bytes).map_err(|_| format!("{text:?} is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_decoded_and_typed() {
        let params =
            Params::parse(Some("pid=42&format=svg&sort=gr%6Fwth&seconds=5"), ReportAsked::PARAMETERS)
                .expect("a good query");
        assert_eq!(params.pid(), Ok(42));
        assert_eq!(params.window(), Ok(Some(Duration::from_secs(5))));
        let asked = ReportAsked::of(&params).expect("good values");
        assert_eq!(
            asked,
            ReportAsked {
                format: Format::Svg,
                weight: Weight::Bytes,
                sort: SortKey::Growth,
                top: 10,
                older_ms: None
            }
        );
    }

    #[test]
    fn each_bad_query_gets_its_reason() {
        let refused = |query: &str| {
            let params = Params::parse(Some(query), ReportAsked::PARAMETERS);
            params.and_then(|params| {
                params.pid().and(params.window()).and(ReportAsked::of(&params).map(|_| ()))
            })
        };
        let reason = |query: &str| refused(query).expect_err(query);
        assert!(reason("pid=1&colour=red").starts_with("unknown parameter \"colour\""));
        assert_eq!(reason("pid=1&pid=2"), "parameter \"pid\" is given twice");
        assert_eq!(reason("format=svg"), "which process? add ?pid=PID; /api/v1/targets lists those followed");
        assert_eq!(reason("pid=x"), "pid=\"x\" is not a whole number from 1 to 4294967295");
        assert_eq!(reason("pid=1&seconds=91"), "seconds=\"91\" is not a whole number from 1 to 90");
        assert_eq!(reason("pid=1&format=png"), "format=\"png\" is not one of text, json, folded, svg, pprof");
        assert_eq!(reason("pid=1%"), "\"1%\" has a broken %-escape");
        assert_eq!(reason("pid=%ff"), "\"%ff\" is not UTF-8 once decoded");
        assert_eq!(
            Params::parse(Some("a=1"), &[]).map(|_| ()),
            Err("this endpoint takes no query parameters".to_owned())
        );
    }
}

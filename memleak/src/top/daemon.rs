//! `memleak top --connect URL`: the same view of the processes a
//! running `memleak serve` follows, through its JSON API: the list
//! (`/api/v1/targets`) and each process's latest round with the series
//! of its past (`/api/v1/history`), every interval. The daemon keeps the
//! history, so a view closed and opened again starts where it was.

use std::{path::Path, time::Duration};

use http_body_util::{BodyExt as _, Empty};
use hyper::{body::Bytes, header, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use super::{view::Update, TopError};
use crate::{
    cli::DEFAULT_SERVE_PORT,
    report::{culprit::SkipRules, history::History, Report},
    serve::token::Token,
};

/// How long a request may take before the daemon is said unreachable.
const PATIENCE: Duration = Duration::from_secs(5);

/// A daemon, as `--connect` names it.
#[derive(Clone)]
pub struct Daemon {
    /// `host:port`.
    authority: String,
    /// `Bearer <token>`, with --token-file.
    authorization: Option<String>,
    /// The processes shown; every one the daemon follows when empty.
    pids: Vec<u32>,
}

/// What `/api/v1/targets` says of a process.
#[derive(Deserialize)]
struct Target {
    pid: u32,
    exited: bool,
    detached: bool,
    #[serde(default)]
    overhead_seconds: Option<f64>,
}

#[derive(Deserialize)]
struct TargetList {
    targets: Vec<Target>,
}

/// What `/api/v1/history` answers.
#[derive(Deserialize)]
struct Past {
    report: Option<Report>,
    history: History,
}

impl Daemon {
    /// The daemon at `url` (`http://host:port`, or `host:port`; the port
    /// is memleak serve's when left out).
    pub fn new(url: &str, token_file: Option<&Path>, pids: Vec<u32>) -> Result<Self, TopError> {
        let bad = |why: &str| TopError::Connect(format!("--connect {url}: {why}"));
        let rest = match url.split_once("://") {
            Some(("http", rest)) => rest,
            Some((scheme, _)) => {
                return Err(bad(&format!(
                    "memleak serve speaks plain http, not {scheme}: give http://HOST:PORT"
                )))
            }
            None => url,
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(bad("give the daemon's address alone, as http://HOST:PORT"));
        }
        let has_port = authority.rsplit_once(':').is_some_and(|(_, port)| !port.contains(']'));
        let authority =
            if has_port { authority.to_owned() } else { format!("{authority}:{DEFAULT_SERVE_PORT}") };
        let authorization =
            token_file.map(Token::read).transpose().map_err(TopError::Connect)?.map(|t| t.header());
        Ok(Self { authority, authorization, pids })
    }

    /// `http://host:port`, for the header.
    pub fn describe(&self) -> String {
        format!("http://{}", self.authority)
    }

    /// Each process's latest round, with the daemon's history of it.
    pub async fn round(&self, skips: &SkipRules) -> Result<Vec<Update>, TopError> {
        let list: TargetList = self.get_json("/api/v1/targets").await?;
        let mut updates = Vec::new();
        for target in
            list.targets.iter().filter(|target| self.pids.is_empty() || self.pids.contains(&target.pid))
        {
            let past: Past = match self.get_json(&format!("/api/v1/history?pid={}", target.pid)).await {
                Ok(past) => past,
                // Gone between the two requests.
                Err(TopError::Status(StatusCode::NOT_FOUND, _)) => continue,
                Err(error) => return Err(error),
            };
            let Some(mut report) = past.report else { continue };
            // The daemon's JSON has each stack's culprit, not which of
            // its frames are plumbing, which the view folds.
            report.name_stacks(skips);
            updates.push(Update {
                report,
                exited: target.exited || target.detached,
                overhead_seconds: target.overhead_seconds,
                history: Some(past.history),
            });
        }
        if updates.is_empty() && !self.pids.is_empty() {
            let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
            return Err(TopError::Connect(format!(
                "{} follows no pid {}: its /api/v1/targets lists those it does",
                self.describe(),
                pids.join(", ")
            )));
        }
        Ok(updates)
    }

    /// Process `pid`'s report with every stack, taken when asked.
    pub async fn whole(&self, pid: u32) -> Result<Report, TopError> {
        self.get_json(&format!("/api/v1/report?pid={pid}&format=json&top={}", u32::MAX)).await
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, TopError> {
        let body = tokio::time::timeout(PATIENCE, self.get(path))
            .await
            .map_err(|_| self.unreachable(&format!("no answer in {} s", PATIENCE.as_secs())))??;
        serde_json::from_slice(&body).map_err(|error| {
            TopError::Connect(format!(
                "{}{path} answered what is not memleak's JSON: {error}",
                self.describe()
            ))
        })
    }

    async fn get(&self, path: &str) -> Result<Bytes, TopError> {
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|error| self.unreachable(&crate::status::os_reason(&error)))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| self.unreachable(&error.to_string()))?;
        tokio::spawn(connection);
        let mut request = Request::get(path).header(header::HOST, &self.authority);
        if let Some(authorization) = &self.authorization {
            request = request.header(header::AUTHORIZATION, authorization);
        }
        let request =
            request.body(Empty::<Bytes>::new()).map_err(|error| self.unreachable(&error.to_string()))?;
        let response =
            sender.send_request(request).await.map_err(|error| self.unreachable(&error.to_string()))?;
        let status = response.status();
        let body =
            response.into_body().collect().await.map_err(|error| self.unreachable(&error.to_string()))?;
        let body = body.to_bytes();
        match status {
            StatusCode::OK => Ok(body),
            StatusCode::UNAUTHORIZED => Err(TopError::Connect(match self.authorization {
                None => format!("{} wants a token: give --token-file FILE", self.describe()),
                Some(_) => format!("{} refused the token of --token-file", self.describe()),
            })),
            status => {
                let said = String::from_utf8_lossy(&body).trim().to_owned();
                Err(TopError::Status(status, format!("{}{path}: {status}: {said}", self.describe())))
            }
        }
    }

    fn unreachable(&self, why: &str) -> TopError {
        TopError::Connect(format!("cannot reach memleak serve at {}: {why}", self.describe()))
    }
}

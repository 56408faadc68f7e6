//! `MetadataStore` over Mooncake's HTTP metadata REST interface
//! (`GET/PUT/DELETE <base>?key=K`, see `docs/wire.md`).

use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};
use crate::http::{percent_encode, HttpClient};
use crate::metadata::MetadataStore;

/// The REST base used when the URL has no path.
pub const DEFAULT_BASE_PATH: &str = "/metadata";

/// A metadata store client for `http://host:port/metadata`-style URLs.
#[derive(Debug)]
pub struct HttpMetadataStore {
    client: HttpClient,
    url: String,
    base: String,
}

impl HttpMetadataStore {
    /// `url` is the REST base, e.g. `http://127.0.0.1:8080/metadata`; a URL without
    /// a path uses `/metadata`. Nothing is contacted until the first operation.
    pub fn new(url: &str) -> Result<HttpMetadataStore> {
        let client = HttpClient::new(url).map_err(|e| {
            Error::new(
                Code::Metadata,
                format!("metadata server {url}: {}", e.context()),
            )
        })?;
        let base = match client.base_path() {
            "" => DEFAULT_BASE_PATH.to_owned(),
            p => p.to_owned(),
        };
        Ok(HttpMetadataStore {
            client,
            url: url.to_owned(),
            base,
        })
    }

    /// Signs every write with `secret` (`crate::http::signed`); `None` signs nothing.
    pub fn with_secret(mut self, secret: Option<ClusterSecret>) -> HttpMetadataStore {
        self.client = self.client.with_secret(secret);
        self
    }

    /// The URL this store talks to.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn call(&self, method: &str, key: &str, body: &[u8]) -> Result<(u16, String)> {
        let target = format!("{}?key={}", self.base, percent_encode(key));
        let (status, body) = self.client.request(method, &target, body).map_err(|e| {
            Error::new(Code::Metadata, format!("metadata server {}: {e}", self.url))
        })?;
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    fn unexpected(&self, op: &str, key: &str, status: u16, body: &str) -> Error {
        Error::new(
            Code::Metadata,
            format!(
                "metadata server {}: {op} {key:?} failed with status {status}: {}",
                self.url,
                body.trim()
            ),
        )
    }
}

impl MetadataStore for HttpMetadataStore {
    fn get(&self, key: &str) -> Result<Option<String>> {
        match self.call("GET", key, b"")? {
            (200, body) => Ok(Some(body)),
            (404, _) => Ok(None),
            (status, body) => Err(self.unexpected("get", key, status, &body)),
        }
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        match self.call("PUT", key, value.as_bytes())? {
            (200..=299, _) => Ok(()),
            (status, body) => Err(self.unexpected("put", key, status, &body)),
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        match self.call("DELETE", key, b"")? {
            (200..=299 | 404, _) => Ok(()),
            (status, body) => Err(self.unexpected("remove", key, status, &body)),
        }
    }
}

//! Control socket: one JSON request per line, one JSON response per line,
//! over a unix socket that only its owner can open (mode 0600 in a 0700
//! directory).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default runtime directory of the daemon.
pub const RUNTIME_DIR: &str = "/run/tmem";
/// Largest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

/// A control request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    /// Daemon state and what it set up.
    Status,
    /// Every counter of every device.
    Stat,
    /// Change a knob of one device at run time.
    Set {
        /// Device name.
        device: String,
        /// Knob.
        key: String,
        /// New value.
        value: String,
    },
    /// Orderly teardown: swapoff, detach, unmount, exit.
    Down,
}

/// A control response.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Result.
    #[serde(default)]
    pub data: serde_json::Value,
}

impl Response {
    /// A success carrying `data`.
    pub fn ok(data: serde_json::Value) -> Self {
        Self { ok: true, error: None, data }
    }

    /// A failure.
    pub fn err(e: impl std::fmt::Display) -> Self {
        Self { ok: false, error: Some(e.to_string()), data: serde_json::Value::Null }
    }
}

/// Path of the control socket in `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("ctl.sock")
}

/// Sends one request and waits up to `timeout` for the answer.
pub fn call(dir: &Path, req: &Request, timeout: Duration) -> Result<Response, String> {
    let path = socket_path(dir);
    let mut s = UnixStream::connect(&path).map_err(|e| format!("no tmem daemon at {} ({e})", path.display()))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    s.write_all(line.as_bytes()).map_err(|e| format!("control socket: {e}"))?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(|e| format!("control socket: {e}"))?;
    if answer.is_empty() {
        return Err("the daemon closed the control socket without answering".into());
    }
    serde_json::from_str(&answer).map_err(|e| format!("bad answer from the daemon: {e}"))
}

/// Sends a request and turns a refusal into an error.
pub fn call_ok(dir: &Path, req: &Request, timeout: Duration) -> Result<serde_json::Value, String> {
    let r = call(dir, req, timeout)?;
    if r.ok {
        Ok(r.data)
    } else {
        Err(r.error.unwrap_or_else(|| "request failed".into()))
    }
}

/// Reads one request line (bounded) from a client.
pub fn read_request(stream: &UnixStream) -> Result<Request, String> {
    let mut line = String::new();
    let mut reader = BufReader::new(stream).take(MAX_REQUEST as u64);
    reader.read_line(&mut line).map_err(|e| e.to_string())?;
    if !line.ends_with('\n') {
        return Err(format!("request line missing or longer than {MAX_REQUEST} bytes"));
    }
    serde_json::from_str(&line).map_err(|e| format!("bad request: {e}"))
}

use std::io::Read as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_input_is_refused() {
        for r in [
            Request::Status,
            Request::Stat,
            Request::Down,
            Request::Set { device: "swap0".into(), key: "frozen".into(), value: "1".into() },
        ] {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        }
        assert!(serde_json::from_str::<Request>(r#"{"cmd":"reboot"}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"cmd":"set","device":"x"}"#).is_err());
    }

    #[test]
    fn read_request_bounds_the_line() {
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"{\"cmd\":\"stat\"}\n").unwrap();
        assert_eq!(read_request(&a).unwrap(), Request::Stat);
        let (a, mut b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let _ = b.write_all(&vec![b'x'; MAX_REQUEST + 10]);
        });
        assert!(read_request(&a).unwrap_err().contains("longer"));
    }
}

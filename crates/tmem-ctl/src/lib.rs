//! The control protocol between the `tmem` command line and its daemon: one
//! JSON request per line, one JSON answer per line, over a unix socket that
//! only its owner can open (mode 0600 in a 0700 directory; the daemon also
//! checks the peer's uid).
//!
//! Requests are bounded ([`MAX_REQUEST`] bytes) and parsed by one function,
//! [`parse_request`], which the fuzz target `ctl_request` drives. Clients
//! set read and write timeouts, and the daemon serves each client on its own
//! thread with a deadline for its whole request, so one silent or slow client
//! delays nobody.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Default runtime directory of the daemon.
pub const RUNTIME_DIR: &str = "/run/tmem";
/// Name of the control socket in the runtime directory.
pub const SOCKET: &str = "ctl.sock";
/// Largest request line accepted, newline included.
pub const MAX_REQUEST: usize = 64 * 1024;
/// Largest answer a client reads.
pub const MAX_ANSWER: u64 = 64 << 20;

/// Control protocol errors.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// No daemon listens (or the socket cannot be reached).
    #[error("no tmem daemon at {path} ({source})")]
    NoDaemon {
        /// Socket path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed (or timed out).
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    /// The request line has no newline within the bound.
    #[error("request line missing or longer than {MAX_REQUEST} bytes")]
    TooLong,
    /// The whole request did not arrive within its time.
    #[error("the request did not arrive whole within {} s", .0.as_secs_f64())]
    Slow(Duration),
    /// The request is not valid UTF-8 JSON of a known command.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The daemon closed the socket without an answer.
    #[error("the daemon closed the control socket without answering")]
    NoAnswer,
    /// The answer is not valid.
    #[error("bad answer from the daemon: {0}")]
    BadAnswer(String),
    /// The daemon refused the request.
    #[error("{0}")]
    Refused(String),
}

/// A control request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase", deny_unknown_fields)]
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

    /// The line sent for this answer, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self)
            .unwrap_or_else(|e| serde_json::json!({ "ok": false, "error": e.to_string() }).to_string());
        line.push('\n');
        line
    }
}

/// What the daemon set up, answered to `status`.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Status {
    /// `starting`, `up`, `stopping`; a successor of a restart that takes
    /// ublk devices over is `recovering ublk devices` until it has.
    pub state: String,
    /// Daemon pid.
    pub pid: u32,
    /// Steps done, in order, for the CLI to print.
    pub steps: Vec<String>,
    /// Per device: name, FUSE file, loop device.
    pub devices: Vec<DeviceStatus>,
    /// NBD URIs of the devices, when served over NBD.
    #[serde(default)]
    pub nbd_uris: Vec<String>,
    /// How the kernel reaches the devices (`fuse` or `nbd`), once chosen.
    #[serde(default)]
    pub transport: Option<String>,
    /// Why that transport was chosen.
    #[serde(default)]
    pub transport_reason: Option<String>,
    /// How FUSE requests reach the daemon (`/dev/fuse` or io_uring), when mounted.
    #[serde(default)]
    pub fuse_transport: Option<String>,
    /// FUSE requests served over io_uring so far.
    #[serde(default)]
    pub fuse_uring_requests: u64,
    /// Times a `/dev/fuse` worker polled the empty queue before sleeping.
    #[serde(default)]
    pub fuse_polls: u64,
    /// Of those, the polls that found a request.
    #[serde(default)]
    pub fuse_poll_hits: u64,
    /// Pages the devices' stores hold (their `stored_pages`) when this was taken.
    #[serde(default)]
    pub stored_pages: u64,
    /// When this was taken (seconds since the epoch).
    #[serde(default)]
    pub taken_unix: u64,
    /// The front in use (`zram`, `zswap`; empty: none chosen yet).
    #[serde(default)]
    pub front: String,
    /// Why that front.
    #[serde(default)]
    pub front_reason: String,
}

/// One device's plumbing.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct DeviceStatus {
    /// Device name.
    pub name: String,
    /// FUSE file (`/dev/nbdN` or `/dev/ublkbN` on the NBD and ublk
    /// transports, which have none).
    pub file: PathBuf,
    /// The block device the kernel sees, when attached: a loop device on
    /// the FUSE file, `/dev/nbdN` (then `nbd_index` is N) or `/dev/ublkbN`
    /// (then `ublk_id` is N).
    pub loop_dev: Option<PathBuf>,
    /// N of `/dev/nbdN`, on the NBD transport.
    #[serde(default)]
    pub nbd_index: Option<u32>,
    /// N of `/dev/ublkbN`, on the ublk transport.
    #[serde(default)]
    pub ublk_id: Option<u32>,
    /// Whether swap is on (on the front's device where there is one).
    pub swap: bool,
    /// The front's device swap is on, in front of the loop device (zram).
    #[serde(default)]
    pub front_node: Option<PathBuf>,
    /// N of that `zramN`.
    #[serde(default)]
    pub front_zram: Option<u32>,
}

/// Path of the control socket in `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(SOCKET)
}

/// Where this user's `tmem run` instances listen: `<pid>/ctl.sock` in
/// `$XDG_RUNTIME_DIR/tmem-run`, or in `/tmp/tmem-run-UID` without it. An
/// unprivileged user has no `/run/tmem`, and each user sees only their own
/// runs. Not created here.
#[must_use]
pub fn runs_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| Path::new(d).is_absolute()) {
        Some(d) => Path::new(&d).join("tmem-run"),
        None => std::env::temp_dir().join(format!("tmem-run-{}", rustix::process::geteuid().as_raw())),
    }
}

/// Makes `dir` (and the per-run directory `dir/PID`) if missing, mode 0700,
/// and refuses a directory that is a symbolic link or that another user
/// owns or can write: a control socket there could be someone else's.
pub fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{} is not a directory of uid {me} that only it can write", dir.display()),
        ));
    }
    Ok(())
}

/// The `tmem run` instances in [`runs_dir`]: each one's pid and directory
/// (for [`call`]), lowest pid first. Entries of runs that died (SIGKILL)
/// are listed too; a [`call`] to them fails with [`CtlError::NoDaemon`].
#[must_use]
pub fn runs() -> Vec<(u32, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(runs_dir()) else { return Vec::new() };
    let mut found: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let pid = e.file_name().to_str()?.parse().ok()?;
            socket_path(&e.path()).exists().then(|| (pid, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Parses one request line (as read, newline included).
pub fn parse_request(line: &[u8]) -> Result<Request, CtlError> {
    if line.len() > MAX_REQUEST || line.last() != Some(&b'\n') {
        return Err(CtlError::TooLong);
    }
    let text = std::str::from_utf8(line).map_err(|e| CtlError::BadRequest(e.to_string()))?;
    serde_json::from_str(text).map_err(|e| CtlError::BadRequest(e.to_string()))
}

/// Reads one request line from a client: at most [`MAX_REQUEST`] bytes,
/// all of it within `within`. The time is a total, not a timeout per read:
/// a client that sends a byte at a time is cut off at the same deadline
/// (finding: 16 such clients kept every control command "busy").
pub fn read_request(stream: &UnixStream, within: Duration) -> Result<Request, CtlError> {
    let deadline = Instant::now() + within;
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    while line.len() < MAX_REQUEST {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CtlError::Slow(within));
        }
        stream.set_read_timeout(Some(left))?;
        let want = (MAX_REQUEST - line.len()).min(buf.len());
        let n = match std::io::Read::read(&mut &*stream, &mut buf[..want]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(CtlError::Slow(within));
            }
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            break;
        }
        if let Some(end) = buf[..n].iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&buf[..=end]);
            break;
        }
        line.extend_from_slice(&buf[..n]);
    }
    parse_request(&line)
}

/// Sends one request and waits up to `timeout` for the answer.
pub fn call(dir: &Path, req: &Request, timeout: Duration) -> Result<Response, CtlError> {
    let path = socket_path(dir);
    let mut s = UnixStream::connect(&path).map_err(|source| CtlError::NoDaemon { path: path.clone(), source })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_string(req).map_err(|e| CtlError::BadRequest(e.to_string()))?;
    line.push('\n');
    // A daemon that refuses at once (busy, not the owner) answers and
    // closes before reading: its answer is still there after a failed write.
    let wrote = s.write_all(line.as_bytes());
    let mut answer = String::new();
    let read = BufReader::new(std::io::Read::take(s, MAX_ANSWER)).read_line(&mut answer);
    if answer.is_empty() {
        wrote?;
        read?;
        return Err(CtlError::NoAnswer);
    }
    serde_json::from_str(&answer).map_err(|e| CtlError::BadAnswer(e.to_string()))
}

/// Sends a request and turns a refusal into an error.
pub fn call_ok(dir: &Path, req: &Request, timeout: Duration) -> Result<serde_json::Value, CtlError> {
    let r = call(dir, req, timeout)?;
    if r.ok {
        Ok(r.data)
    } else {
        Err(CtlError::Refused(r.error.unwrap_or_else(|| "request failed".into())))
    }
}

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
            let mut s = serde_json::to_string(&r).unwrap();
            s.push('\n');
            assert_eq!(parse_request(s.as_bytes()).unwrap(), r);
        }
        for bad in [
            &br#"{"cmd":"reboot"}"#[..],
            br#"{"cmd":"set","device":"x"}"#,
            br#"{"cmd":"set","device":"x","key":"k","value":"v","extra":1}"#,
            b"\xff\xfe\n",
            b"",
        ] {
            let mut line = bad.to_vec();
            if !line.is_empty() {
                line.push(b'\n');
            }
            assert!(parse_request(&line).is_err(), "{bad:?}");
        }
        assert!(matches!(parse_request(br#"{"cmd":"stat"}"#), Err(CtlError::TooLong)));
    }

    #[test]
    fn read_request_bounds_the_line() {
        let within = Duration::from_secs(5);
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"{\"cmd\":\"stat\"}\n").unwrap();
        assert_eq!(read_request(&a, within).unwrap(), Request::Stat);
        let (a, mut b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let _ = b.write_all(&vec![b'x'; MAX_REQUEST + 10]);
        });
        assert!(matches!(read_request(&a, within), Err(CtlError::TooLong)));
        // A silent client ends at the deadline instead of holding the reader.
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(matches!(read_request(&a, Duration::from_millis(50)), Err(CtlError::Slow(_))));
    }

    /// Finding: the 5 s timeout was per read, so a client that sent a byte
    /// every 4 s held its reader forever.
    #[test]
    fn a_dripping_client_is_cut_off_at_the_deadline() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let drip = std::thread::spawn(move || {
            for byte in b"{\"cmd\":\"stat\"}\n" {
                if b.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let t = Instant::now();
        let e = read_request(&a, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, CtlError::Slow(_)), "{e}");
        assert!(t.elapsed() < Duration::from_millis(400), "{:?}", t.elapsed());
        assert_eq!(e.to_string(), "the request did not arrive whole within 0.2 s");
        drop(a);
        drip.join().unwrap();
    }
}

//! Throwaway `redis-server` processes on loopback for the remote-tier
//! benchmarks (and the tests of the remote tier): no persistence, a private
//! scratch directory, each killed by its own pid when dropped.
//!
//! ```no_run
//! use tmem_bench::redis::{RedisOptions, RedisServer};
//! let server = RedisServer::start(&RedisOptions::default()).expect("redis-server");
//! let url = server.url();
//! ```

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

pub mod cluster;

/// Certificate files for a TLS server (see [`make_test_certs`]).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The CA certificate (PEM) clients trust.
    pub ca_cert: PathBuf,
    /// The server certificate (PEM), for `127.0.0.1` and `localhost`.
    pub cert: PathBuf,
    /// The server key (PEM).
    pub key: PathBuf,
}

/// Options of a test server.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `maxmemory` (e.g. `"2mb"`); `None`: no limit.
    pub maxmemory: Option<String>,
    /// `maxmemory-policy`.
    pub policy: String,
    /// `requirepass` (password of the `default` user).
    pub requirepass: Option<String>,
    /// ACL rules, one `user` directive each, e.g. `"alice on >pw ~tmem:* +@all"`.
    pub acl_users: Vec<String>,
    /// Serve TLS only, with these certificates (clients need not present one).
    pub tls: Option<TlsFiles>,
    /// Run inside this network namespace (`ip netns exec`), bound to this
    /// address of it, on port 6379; `None`: 127.0.0.1, a free port.
    pub netns: Option<(String, std::net::Ipv4Addr)>,
    /// `--cluster-enabled yes` (see [`cluster::RedisCluster`]).
    pub cluster: bool,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            maxmemory: None,
            policy: "noeviction".into(),
            requirepass: None,
            acl_users: Vec::new(),
            tls: None,
            netns: None,
            cluster: false,
        }
    }
}

/// The `redis-server` binary on `PATH`, if any.
pub fn redis_server_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("redis-server")).find(|p| p.is_file())
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A `redis-server` child process on 127.0.0.1, killed (by its pid) on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Child,
    port: u16,
    tls: bool,
    running: bool,
    dir: tempfile::TempDir,
    opts: RedisOptions,
}

impl RedisServer {
    /// Starts a server on a free loopback port (`--bind 127.0.0.1`, no
    /// persistence, not daemonized) and waits until it accepts connections.
    pub fn start(opts: &RedisOptions) -> io::Result<Self> {
        let bin = redis_server_binary()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "redis-server not installed"))?;
        let mut last = None;
        // The port is released before the server binds it; another process may take it meanwhile.
        for _ in 0..5 {
            match Self::try_start(&bin, opts) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    fn try_start(bin: &Path, opts: &RedisOptions) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tmem-redis-").tempdir()?;
        let port = if opts.netns.is_some() { 6379 } else { free_port()? };
        let child = spawn(bin, opts, port, dir.path())?;
        let mut server = Self { child, port, tls: opts.tls.is_some(), running: true, dir, opts: opts.clone() };
        server.wait_ready()?;
        Ok(server)
    }

    /// Starts the server again on the same port with the same options (and
    /// no data), after [`kill`](Self::kill).
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let bin = redis_server_binary()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "redis-server not installed"))?;
        let _ = std::fs::remove_file(self.dir.path().join("redis.log"));
        self.child = spawn(&bin, &self.opts, self.port, self.dir.path())?;
        self.running = true;
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.running = false;
                return Err(io::Error::other(format!("redis-server exited with {status}: {}", self.log())));
            }
            if self.log().contains("Ready to accept connections") && self.accepts() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!("redis-server not ready after 10 s: {}", self.log())));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn accepts(&self) -> bool {
        let Ok(mut s) = TcpStream::connect((self.host(), self.port)) else { return false };
        if self.tls {
            return true;
        }
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 64];
        // +PONG, or -NOAUTH when a password is required: either way it serves.
        s.write_all(b"PING\r\n").is_ok() && matches!(s.read(&mut buf), Ok(n) if n > 0)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` for a TLS server), without credentials.
    pub fn url(&self) -> String {
        format!("{}://{}:{}", if self.tls { "rediss" } else { "redis" }, self.host(), self.port)
    }

    /// The address it is bound to.
    #[must_use]
    pub fn host(&self) -> std::net::Ipv4Addr {
        self.opts.netns.as_ref().map_or(std::net::Ipv4Addr::LOCALHOST, |(_, a)| *a)
    }

    /// `host:port`.
    #[must_use]
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host(), self.port)
    }

    /// The URL with a user (may be empty, for `requirepass`) and password.
    pub fn url_with_auth(&self, user: &str, password: &str) -> String {
        format!("{}://{user}:{password}@{}:{}", if self.tls { "rediss" } else { "redis" }, self.host(), self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// Kills the server with SIGKILL (its own pid only) and reaps it.
    pub fn kill(&mut self) {
        if self.running {
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.running = false;
        }
    }

    /// Stops the server with SIGSTOP (it hangs: connections open, nothing answers).
    pub fn pause(&mut self) -> io::Result<()> {
        self.signal(Signal::STOP)
    }

    /// Continues a paused server (SIGCONT).
    pub fn resume(&mut self) -> io::Result<()> {
        self.signal(Signal::CONT)
    }

    fn signal(&mut self, sig: Signal) -> io::Result<()> {
        if !self.is_running() {
            return Err(io::Error::other("server not running"));
        }
        // Our own, unreaped child: its pid cannot have been reused.
        let pid =
            i32::try_from(self.child.id()).ok().and_then(Pid::from_raw).ok_or_else(|| io::Error::other("bad pid"))?;
        Ok(kill_process(pid, sig)?)
    }

    /// Whether the process is still alive.
    pub fn is_running(&mut self) -> bool {
        self.running && matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn(bin: &Path, opts: &RedisOptions, port: u16, dir: &Path) -> io::Result<Child> {
    // `ip netns exec` execs redis-server after joining the namespace: the child is the server.
    let (mut cmd, host) = match &opts.netns {
        Some((ns, addr)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(bin);
            (c, addr.to_string())
        }
        None => (Command::new(bin), "127.0.0.1".to_owned()),
    };
    cmd.args(["--bind", &host, "--save", "", "--appendonly", "no", "--daemonize", "no"]);
    if opts.netns.is_some() {
        // Protected mode refuses clients from other addresses when no
        // password is set; the namespace is reached only from this host.
        cmd.args(["--protected-mode", "no"]);
    }
    cmd.arg("--dir").arg(dir).arg("--logfile").arg(dir.join("redis.log"));
    cmd.args(["--maxmemory", opts.maxmemory.as_deref().unwrap_or("0")]);
    cmd.args(["--maxmemory-policy", &opts.policy]);
    if opts.cluster {
        // A master is failed over after 1 s without answers, by its replica
        // however stale (validity factor 0); the others go on serving their
        // slots meanwhile.
        cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"]);
        cmd.args(["--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0"]);
        cmd.arg("--cluster-config-file").arg(dir.join("nodes.conf"));
    }
    if let Some(pw) = &opts.requirepass {
        cmd.args(["--requirepass", pw]);
    }
    for rule in &opts.acl_users {
        cmd.arg("--user").args(rule.split_whitespace());
    }
    if let Some(t) = &opts.tls {
        cmd.args(["--port", "0", "--tls-port", &port.to_string(), "--tls-auth-clients", "no"]);
        cmd.arg("--tls-cert-file").arg(&t.cert).arg("--tls-key-file").arg(&t.key);
        cmd.arg("--tls-ca-cert-file").arg(&t.ca_cert);
    } else {
        cmd.args(["--port", &port.to_string()]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    cmd.spawn()
}

//! The service manager above the daemon: systemd's notify protocol
//! (`Type=notify`: `READY=1`, `WATCHDOG=1`, `STOPPING=1`, `MAINPID=`).
//!
//! A daemon that systemd started finds the notify socket and the watchdog
//! in its environment (`NOTIFY_SOCKET`, `WATCHDOG_USEC` for `WATCHDOG_PID`).
//! A successor that `systemctl reload` started (`ExecReload=tmem swap
//! restart`) is not the unit's main process: the predecessor hands it the
//! socket and the watchdog period ([`Handed`]), and once it serves it tells
//! systemd that it is the main process now (`MAINPID=`, which the unit
//! allows with `NotifyAccess=all`), before the predecessor exits.
//!
//! Sent by hand rather than with `sd_notify::notify`, which reads the
//! environment on each call: a successor's socket comes from its
//! predecessor, and a process with threads must not change its environment.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use sd_notify::NotifyState;

/// What a successor needs to speak to its predecessor's service manager.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Handed {
    /// `NOTIFY_SOCKET`: a path, or an abstract name starting with `@`.
    pub notify_socket: String,
    /// The watchdog period, if the unit has one (`WatchdogSec=`).
    pub watchdog_usec: Option<u64>,
}

/// The service manager of this process, if any.
#[derive(Clone, Debug, Default)]
pub struct Supervisor {
    handed: Option<Handed>,
}

impl Supervisor {
    /// What systemd told this process in its environment; no supervisor
    /// without `NOTIFY_SOCKET`.
    #[must_use]
    pub fn from_env() -> Self {
        let Some(socket) = std::env::var_os("NOTIFY_SOCKET").and_then(|s| s.into_string().ok()) else {
            return Self::default();
        };
        let mut usec = 0;
        let watchdog_usec = sd_notify::watchdog_enabled(false, &mut usec).then_some(usec);
        Self { handed: Some(Handed { notify_socket: socket, watchdog_usec }) }
    }

    /// A successor's supervisor: its own if systemd started this very
    /// process (its watchdog is for this pid), else the predecessor's (a
    /// successor that `ExecReload` started), else its own.
    #[must_use]
    pub fn inherit(own: Self, predecessor: Option<Handed>) -> Self {
        if own.watchdog().is_some() {
            return own;
        }
        Self { handed: predecessor.or(own.handed) }
    }

    /// None: nothing supervises this process.
    #[must_use]
    pub fn handed(&self) -> Option<Handed> {
        self.handed.clone()
    }

    /// The watchdog's period, if the unit has one.
    #[must_use]
    pub fn watchdog(&self) -> Option<Duration> {
        self.handed.as_ref()?.watchdog_usec.map(Duration::from_micros)
    }

    /// Sends `states` (one datagram); a no-op without a supervisor. A
    /// failure is returned for the caller to log or ignore.
    pub fn notify(&self, states: &[NotifyState<'_>]) -> std::io::Result<()> {
        let Some(h) = &self.handed else { return Ok(()) };
        let msg: String = states.iter().map(|s| format!("{s}\n")).collect();
        let sock = UnixDatagram::unbound()?;
        match h.notify_socket.strip_prefix('@') {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(msg.as_bytes(), &addr)?;
            }
            None => {
                sock.send_to(msg.as_bytes(), &h.notify_socket)?;
            }
        }
        Ok(())
    }

    /// Tells the service manager that this process is the unit's main
    /// process now, and ready.
    pub fn took_over(&self, status: &str) -> std::io::Result<()> {
        let pid = std::process::id();
        self.notify(&[NotifyState::MainPid(pid), NotifyState::Ready, NotifyState::Status(status)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handed(path: &str, watchdog_usec: Option<u64>) -> Handed {
        Handed { notify_socket: path.into(), watchdog_usec }
    }

    #[test]
    fn a_successor_speaks_to_its_own_manager_only_when_it_started_this_process() {
        let own = |w| Supervisor { handed: Some(handed("/own", w)) };
        // Started by systemd itself (ExecStart): its own socket and watchdog.
        let s = Supervisor::inherit(own(Some(5)), Some(handed("/old", Some(7))));
        assert_eq!(s.handed(), Some(handed("/own", Some(5))));
        // Started by ExecReload: a socket but no watchdog of its own.
        let s = Supervisor::inherit(own(None), Some(handed("/old", Some(7))));
        assert_eq!(s.handed(), Some(handed("/old", Some(7))));
        let s = Supervisor::inherit(own(None), None);
        assert_eq!(s.handed(), Some(handed("/own", None)));
        let s = Supervisor::inherit(own(None), Some(handed("/old", None)));
        assert_eq!(s.handed(), Some(handed("/old", None)));
        let s = Supervisor::inherit(Supervisor::default(), Some(handed("/old", None)));
        assert_eq!(s.handed(), Some(handed("/old", None)));
        assert!(Supervisor::inherit(Supervisor::default(), None).handed().is_none());
    }

    #[test]
    fn notify_sends_one_datagram_to_a_path_and_to_an_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let s = Supervisor { handed: Some(handed(path.to_str().unwrap(), None)) };
        s.took_over("serving").unwrap();
        let mut buf = [0u8; 256];
        let n = listener.recv(&mut buf).unwrap();
        let got = std::str::from_utf8(&buf[..n]).unwrap();
        assert_eq!(got, format!("MAINPID={}\nREADY=1\nSTATUS=serving\n", std::process::id()));

        use std::os::linux::net::SocketAddrExt;
        let name = format!("tmem-test-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name).unwrap();
        let abs = UnixDatagram::bind_addr(&addr).unwrap();
        let s = Supervisor { handed: Some(handed(&format!("@{name}"), None)) };
        s.notify(&[NotifyState::Watchdog]).unwrap();
        let n = abs.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1\n");

        // No manager: nothing to send, no error.
        Supervisor::default().notify(&[NotifyState::Ready]).unwrap();
    }
}

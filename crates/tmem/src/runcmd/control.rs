//! How a `tmem run` instance is seen from outside: its control socket,
//! which answers `tmem stat --runs` (`stat`, `status`) and `tmem set
//! run-PID memory=SIZE`, and `--metrics`.
//! Both reuse the daemon's servers: the same client limits, the same
//! exposition, a run being one more device (`DeviceStats::of_run`).

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use tmem_block::DeviceStats;
use tmem_ctl::{Request, Response, Status};
use tmem_daemon::control::Handler;
use tmem_daemon::human;
use tmem_daemon::metrics::MetricsServer;
use tmem_uffd::manager::Observer;

/// The device name of the run in process `pid`.
fn device_name(pid: u32) -> String {
    format!("run-{pid}")
}

/// The run as a device.
fn device(o: &Observer) -> DeviceStats {
    let (run, store) = o.snapshot();
    DeviceStats::of_run(&device_name(run.pid), store, run)
}

struct RunHandler(Observer);

impl Handler for RunHandler {
    fn handle(&self, req: Request) -> Response {
        match req {
            Request::Stat => match serde_json::to_value(vec![device(&self.0)]) {
                Ok(v) => Response::ok(v),
                Err(e) => Response::err(e),
            },
            Request::Status => {
                let (run, _) = self.0.snapshot();
                let status = Status {
                    state: "up".into(),
                    pid: run.pid,
                    steps: vec![format!("tmem run: {}", run.program)],
                    stored_pages: run.stored_pages,
                    ..Status::default()
                };
                serde_json::to_value(status).map_or_else(Response::err, Response::ok)
            }
            Request::Set { device, key, value } => {
                let name = device_name(std::process::id());
                if device != name {
                    return Response::err(format!("this tmem run instance is {name}, not {device}"));
                }
                if key != "memory" {
                    return Response::err(format!("{key}: a tmem run instance has one knob, memory=SIZE"));
                }
                match tmem_corpus::parse_size(&value) {
                    Ok(bytes) => match self.0.set_memory(bytes) {
                        Ok(()) => Response::ok(format!("memory={bytes} (at most {} resident)", human(bytes)).into()),
                        Err(e) => Response::err(e),
                    },
                    Err(e) => Response::err(format!("memory={value}: {e}")),
                }
            }
            Request::Down => Response::err("a tmem run instance ends with its program, not with swap down"),
        }
    }

    fn answered(&self, _req: &Request) {}
}

/// The run's control socket and metrics endpoint; the socket's directory
/// goes on drop.
pub struct Exposed {
    dir: PathBuf,
    metrics: Option<MetricsServer>,
}

impl Exposed {
    /// Listens at `tmem_ctl::runs_dir()/PID/ctl.sock`, and on `metrics` if given.
    pub fn start(o: &Observer, metrics: Option<(std::net::SocketAddr, bool)>) -> std::io::Result<Self> {
        let runs = tmem_ctl::runs_dir();
        tmem_ctl::make_private_dir(&runs)?;
        let dir = runs.join(std::process::id().to_string());
        // A directory of an earlier process with this pid, dead now.
        let _ = std::fs::remove_dir_all(&dir);
        tmem_ctl::make_private_dir(&dir)?;
        let mut exposed = Self { dir, metrics: None };
        let listener = UnixListener::bind(tmem_ctl::socket_path(&exposed.dir))?;
        tmem_daemon::control::spawn(listener, Arc::new(RunHandler(o.clone())))?;
        exposed.metrics = match metrics {
            Some((addr, remote)) => {
                let o = o.clone();
                let source: tmem_daemon::metrics::Source = Arc::new(move || vec![device(&o)]);
                let server = MetricsServer::start(addr, remote, source).map_err(std::io::Error::other)?;
                eprintln!("tmem run: metrics at http://{}/metrics", server.addr());
                Some(server)
            }
            None => None,
        };
        Ok(exposed)
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        if let Some(m) = self.metrics.take() {
            m.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

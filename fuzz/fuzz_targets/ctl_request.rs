//! The daemon's control-protocol parser: any bytes give a request or one
//! error, never a panic; a parsed request serialises back to a line that
//! parses to the same request.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tmem_ctl::{parse_request, MAX_REQUEST};

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(req) => {
            assert!(data.len() <= MAX_REQUEST && data.ends_with(b"\n"));
            let mut line = serde_json::to_vec(&req).expect("requests serialise");
            line.push(b'\n');
            assert_eq!(parse_request(&line).expect("a serialised request parses"), req);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});

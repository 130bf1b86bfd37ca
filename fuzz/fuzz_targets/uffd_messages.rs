//! What `tmem run`'s helper reads: an agent's hello (any bytes give a hello
//! or one error, and a hello encodes back to the same bytes' meaning) and
//! the kernel's userfaultfd messages (any 32 bytes give an event).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tmem_uffd::proto::Hello;
use tmem_uffd::sys::{parse_msg, MSG_LEN};

fuzz_target!(|data: &[u8]| {
    match Hello::decode(data) {
        Ok(h) => assert_eq!(Hello::decode(&h.encode()).expect("an encoded hello decodes"), h),
        Err(e) => {
            let _ = e.to_string();
        }
    }
    for chunk in data.chunks_exact(MSG_LEN) {
        let _ = parse_msg(chunk.try_into().expect("a whole message"));
    }
});

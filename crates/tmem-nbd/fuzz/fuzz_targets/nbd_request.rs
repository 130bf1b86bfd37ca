//! The pure protocol parsers on arbitrary bytes: the request header (the
//! main target), and the handshake parsers (client flags, option header,
//! NBD_OPT_INFO/GO data, meta context data), chosen by the first byte.
//! None may panic; accepted requests must round-trip through the encoder.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tmem_nbd::proto;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else { return };
    match selector % 8 {
        // Most inputs go to the request header parser.
        0..=3 => {
            if let Ok(r) = proto::parse_request(rest) {
                let encoded = proto::encode_request(&r);
                assert_eq!(&encoded[..], &rest[..proto::REQUEST_SIZE]);
                assert_eq!(proto::parse_request(&encoded), Ok(r));
            }
        }
        4 => {
            if let Ok(h) = proto::parse_option_header(rest) {
                assert_eq!(u64::from_be_bytes(rest[..8].try_into().unwrap()), proto::IHAVEOPT);
                let _ = (h.option, h.len);
            }
            let _ = proto::parse_client_flags(rest);
        }
        5 | 6 => {
            if let Ok(req) = proto::parse_info_request(rest) {
                // Consumed exactly: name, count, requests.
                assert_eq!(4 + req.name.len() + 2 + 2 * req.requests.len(), rest.len());
            }
        }
        _ => {
            if let Ok(req) = proto::parse_meta_request(rest) {
                let used: usize = 8 + req.export.len() + req.queries.iter().map(|q| 4 + q.len()).sum::<usize>();
                assert_eq!(used, rest.len());
                for q in &req.queries {
                    assert!(q.contains(&b':') && q.len() <= proto::MAX_STRING);
                    let _ = proto::meta_query_selects_allocation(q, true);
                }
            }
        }
    }
});

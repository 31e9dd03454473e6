//! Handle signatures, as vLLM 0.33 signs its shared-memory cache handles:
//! `HMAC-SHA256(secret, SHA-256(key) ‖ address as u64 LE ‖ id as u32 LE)`,
//! with a 32-byte random secret kept in the segment. A signature binds a
//! handle to the key it was issued for, so a reader can tell a handle that
//! was tampered with or paired with the wrong key.
//!
//! The id enters as its low 32 bits, as vLLM's wire id does (its ids are
//! 32-bit); the slot's own check still compares all 64 bits.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Bytes of a signature (an HMAC-SHA256 tag).
pub const SIGNATURE_LEN: usize = 32;

/// A handle signature.
pub type Signature = [u8; SIGNATURE_LEN];

fn mac(secret: &[u8; 32], key: &str, address: u64, id: u64) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(&Sha256::digest(key.as_bytes()));
    mac.update(&address.to_le_bytes());
    mac.update(&(id as u32).to_le_bytes());
    mac
}

/// The signature of `key` at `address:id`.
pub(crate) fn sign(secret: &[u8; 32], key: &str, address: u64, id: u64) -> Signature {
    mac(secret, key, address, id).finalize().into_bytes().into()
}

/// Whether `signature` is that of `key` at `address:id` (compared in
/// constant time). A signature of another length never is.
pub(crate) fn verify(
    secret: &[u8; 32],
    key: &str,
    address: u64,
    id: u64,
    signature: &[u8],
) -> bool {
    mac(secret, key, address, id)
        .verify_slice(signature)
        .is_ok()
}

/// 32 random bytes from the operating system, for a new segment's secret.
pub(crate) fn new_secret() -> Result<[u8; 32]> {
    let mut s = [0u8; 32];
    getrandom::fill(&mut s).map_err(|e| Error::Os {
        op: "getrandom",
        name: String::new(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expected tag was computed with Python's hmac and hashlib, as
    /// vLLM computes it:
    /// `hmac.new(secret, sha256(key).digest() + addr.to_bytes(8, "little")
    /// + (id & 0xffffffff).to_bytes(4, "little"), "sha256")`.
    #[test]
    fn signatures_match_the_reference_computation() {
        let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
        let want = "4701270f8e1bacd121292245070f00dd0757b5a5ff32a94ceb9031a52fd96728";
        let hex = |s: Signature| s.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(sign(&secret, "image-0", 4096, 7)), want);
        // Only the id's low 32 bits enter, as on vLLM's wire.
        assert_eq!(hex(sign(&secret, "image-0", 4096, (1 << 32) + 7)), want);
        let sig = sign(&secret, "image-0", 4096, 7);
        assert!(verify(&secret, "image-0", 4096, 7, &sig));
        assert!(!verify(&secret, "image-1", 4096, 7, &sig), "wrong key");
        assert!(!verify(&secret, "image-0", 4160, 7, &sig), "wrong address");
        assert!(!verify(&secret, "image-0", 4096, 8, &sig), "wrong id");
        assert!(!verify(&secret, "image-0", 4096, 7, &sig[..31]), "short");
        let mut bad = sig;
        bad[5] ^= 1;
        assert!(!verify(&secret, "image-0", 4096, 7, &bad), "tampered");
    }
}

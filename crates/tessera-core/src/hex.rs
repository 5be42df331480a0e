//! Lowercase hexadecimal text of digests (content hashes in canonical mask text, contract keys,
//! fingerprints): two characters per byte, most significant nibble first.

/// `bytes` as lowercase hex, e.g. `[0x0f, 0xa0]` as `"0fa0"`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_byte_is_its_two_digit_lowercase_hex() {
        let all: Vec<u8> = (0..=255).collect();
        let want: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(super::hex(&all), want);
        assert_eq!(super::hex(&[]), "");
    }
}

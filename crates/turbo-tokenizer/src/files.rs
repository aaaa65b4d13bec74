//! Reading a model directory's text files (configs, the tokenizer, chat templates) without
//! trusting them: only regular files are opened (a FIFO would block the open, a device such as
//! `/dev/zero` would never end), and a file larger than [`MODEL_TEXT_LIMIT`] is refused before
//! anything is read.

use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// The largest text file of a model directory that is read: tokenizers of large vocabularies are
/// tens of MB; nothing legitimate comes near this.
pub const MODEL_TEXT_LIMIT: u64 = 256 << 20;

/// The whole of the regular file at `path` (symbolic links followed) as UTF-8 text, at most
/// [`MODEL_TEXT_LIMIT`] bytes; anything else is an error of kind `InvalidInput` (not a regular
/// file, too large) or `InvalidData` (not UTF-8), and a missing file `NotFound`.
pub fn read_model_text(path: &Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "not a regular file (a directory, device or pipe)",
        ));
    }
    if meta.len() > MODEL_TEXT_LIMIT {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("larger than {} MiB", MODEL_TEXT_LIMIT >> 20),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // A file that grows while it is read still stops at the limit.
    std::fs::File::open(path)?
        .take(MODEL_TEXT_LIMIT + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MODEL_TEXT_LIMIT {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("larger than {} MiB", MODEL_TEXT_LIMIT >> 20),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::new(
            ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_regular_files_and_refuses_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("config.json");
        std::fs::write(&ok, "{\"a\": 1}").unwrap();
        assert_eq!(read_model_text(&ok).unwrap(), "{\"a\": 1}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, [b'{', 0xff, b'}']).unwrap();
        assert_eq!(
            read_model_text(&bad).unwrap_err().kind(),
            ErrorKind::InvalidData
        );
        assert_eq!(
            read_model_text(&dir.path().join("missing"))
                .unwrap_err()
                .kind(),
            ErrorKind::NotFound
        );
        // A directory, and (on Unix) a device that never ends, are refused before reading.
        assert_eq!(
            read_model_text(dir.path()).unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
        #[cfg(unix)]
        {
            let zero = dir.path().join("zero.json");
            std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
            assert_eq!(
                read_model_text(&zero).unwrap_err().kind(),
                ErrorKind::InvalidInput
            );
        }
    }
}

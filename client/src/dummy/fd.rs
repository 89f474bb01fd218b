//! Passing a file descriptor with a frame over a Unix domain socket
//! (`SCM_RIGHTS`).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Sends all of `bytes` on `socket`, the first part with `fd` attached.
///
/// # Errors
/// When the socket fails.
pub fn send_with_fd(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !ancillary.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the descriptor"));
    }
    let mut sent = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(bytes)],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    )?;
    while sent < bytes.len() {
        sent += rustix::io::write(socket, &bytes[sent..])?;
    }
    Ok(())
}

/// Receives up to `buffer.len()` bytes and the descriptor sent with them, if any.
///
/// # Errors
/// When the socket fails (`WouldBlock` on a non-blocking socket without data).
pub fn recv_with_fd(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
) -> std::io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = RecvAncillaryBuffer::new(&mut space);
    let received = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(buffer)],
        &mut ancillary,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for message in ancillary.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for received in fds {
                // The first descriptor is the region; any other is closed here.
                if fd.is_none() {
                    fd = Some(received);
                }
            }
        }
    }
    Ok((received.bytes, fd))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_descriptor_travels_with_its_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        file.set_len(123).unwrap();
        send_with_fd(a.as_fd(), b"hello", file.as_fd()).unwrap();
        let mut buffer = [0u8; 16];
        let (n, fd) = recv_with_fd(b.as_fd(), &mut buffer).unwrap();
        assert_eq!(&buffer[..n], b"hello");
        let received = std::fs::File::from(fd.unwrap());
        assert_eq!(received.metadata().unwrap().len(), 123);
    }
}

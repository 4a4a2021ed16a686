//! [`ResponseBody`]: the body of a response that went through the response cache: a stored
//! page's bytes, the origin's body as it streams, or a body the cache began to read and gives
//! back whole.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The body of a response from a [`ResponseCache`](super::ResponseCache) service: a stored page's
/// bytes, or the origin's own body (streamed as it comes, never truncated). axum takes it as
/// it takes any `http_body::Body<Data = Bytes>`.
pub struct ResponseBody<B: Body> {
    kind: Kind<B>,
}

enum Kind<B: Body> {
    /// A stored page (`None` once sent).
    Full(Option<Bytes>),
    /// The origin's body, untouched.
    Inner(Pin<Box<B>>),
    /// The frames the cache read before it found the body could not be stored, then the error
    /// it ended with or the rest of it.
    Replay {
        frames: VecDeque<Frame<Bytes>>,
        error: Option<B::Error>,
        rest: Option<Pin<Box<B>>>,
    },
}

// Nothing in it is ever pinned in place: the origin's body is boxed, and an error or a frame is
// only moved out.
impl<B: Body> Unpin for ResponseBody<B> {}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Full(_) => "stored",
            Kind::Inner(_) => "origin",
            Kind::Replay { .. } => "origin (replayed)",
        };
        f.debug_struct("ResponseBody")
            .field("from", &kind)
            .finish_non_exhaustive()
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Full(Some(bytes)),
        }
    }

    pub(crate) fn empty() -> Self {
        ResponseBody {
            kind: Kind::Full(None),
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner(Box::pin(body)),
        }
    }

    pub(crate) fn replay(
        frames: Vec<Frame<Bytes>>,
        error: Option<B::Error>,
        rest: Option<Pin<Box<B>>>,
    ) -> Self {
        ResponseBody {
            kind: Kind::Replay {
                frames: frames.into(),
                error,
                rest,
            },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::Inner(body) => body.as_mut().poll_frame(cx),
            Kind::Replay {
                frames,
                error,
                rest,
            } => {
                if let Some(frame) = frames.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(e) = error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                match rest {
                    Some(body) => body.as_mut().poll_frame(cx),
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(bytes) => bytes.is_none(),
            Kind::Inner(body) => body.is_end_stream(),
            Kind::Replay {
                frames,
                error,
                rest,
            } => {
                frames.is_empty()
                    && error.is_none()
                    && rest.as_ref().is_none_or(|b| b.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Inner(body) => body.size_hint(),
            Kind::Replay { .. } => SizeHint::default(),
        }
    }
}

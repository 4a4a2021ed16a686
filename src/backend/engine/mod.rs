//! The pipelined, auto-batching memcached engine (tokio). PLACEHOLDER until the engine branch
//! lands: refuses to build.

use crate::backend::memcached::MemcachedConfig;
use crate::error::{Error, Result};

/// Placeholder.
#[derive(Debug)]
pub(crate) struct Engine;

impl Engine {
    pub(crate) fn new(_: &MemcachedConfig, _: usize) -> Result<Engine> {
        Err(Error::config("the async memcached engine is not built yet"))
    }
}

impl crate::backend::AsyncBackend for Engine {
    fn get<'a>(
        &'a self,
        _: &'a str,
    ) -> crate::backend::BoxFuture<'a, Result<Option<crate::backend::Item>>> {
        unimplemented!()
    }
    fn get_many<'a>(
        &'a self,
        _: &'a [&'a str],
    ) -> crate::backend::BoxFuture<'a, Vec<Result<Option<crate::backend::Item>>>> {
        unimplemented!()
    }
    fn store<'a>(
        &'a self,
        _: crate::backend::Write<'a>,
    ) -> crate::backend::BoxFuture<'a, Result<crate::backend::StoreOutcome>> {
        unimplemented!()
    }
    fn store_then_get<'a>(
        &'a self,
        _: crate::backend::Write<'a>,
    ) -> crate::backend::BoxFuture<
        'a,
        Result<(crate::backend::StoreOutcome, Option<crate::backend::Item>)>,
    > {
        unimplemented!()
    }
    fn store_many<'a>(
        &'a self,
        _: &'a [crate::backend::Write<'a>],
    ) -> crate::backend::BoxFuture<'a, Vec<Result<crate::backend::StoreOutcome>>> {
        unimplemented!()
    }
    fn delete<'a>(&'a self, _: &'a str) -> crate::backend::BoxFuture<'a, Result<bool>> {
        unimplemented!()
    }
    fn delete_many<'a>(
        &'a self,
        _: &'a [&'a str],
    ) -> crate::backend::BoxFuture<'a, Vec<Result<bool>>> {
        unimplemented!()
    }
    fn touch<'a>(&'a self, _: &'a str, _: u32) -> crate::backend::BoxFuture<'a, Result<bool>> {
        unimplemented!()
    }
    fn incr<'a>(
        &'a self,
        _: &'a str,
        _: u64,
    ) -> crate::backend::BoxFuture<'a, Result<Option<u64>>> {
        unimplemented!()
    }
    fn decr<'a>(
        &'a self,
        _: &'a str,
        _: u64,
    ) -> crate::backend::BoxFuture<'a, Result<Option<u64>>> {
        unimplemented!()
    }
    fn flush_all(&self) -> crate::backend::BoxFuture<'_, Result<()>> {
        unimplemented!()
    }
    fn max_value_size(&self, _: &str) -> usize {
        0
    }
}

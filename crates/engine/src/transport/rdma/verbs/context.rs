//! The device list and an opened device context.

use std::ffi::c_int;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::ffi::ibverbs::{self as ibv, Verbs};

/// `ibv_get_device_list`'s answer, freed on drop.
pub struct DeviceList {
    verbs: &'static Verbs,
    list: NonNull<*mut ibv::ibv_device>,
    names: Vec<String>,
}

impl DeviceList {
    /// The devices present. An error is `ibv_get_device_list`'s errno (no kernel driver,
    /// for instance); an empty list is no devices.
    pub fn new(verbs: &'static Verbs) -> io::Result<DeviceList> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-parameter; the list is owned from here on.
        let list = unsafe { (verbs.get_device_list)(&mut count) };
        let list = NonNull::new(list).ok_or_else(io::Error::last_os_error)?;
        let names = (0..count.max(0) as usize)
            // SAFETY: the list holds `count` live device pointers while it is not freed.
            .map(|i| unsafe { ibv::device_name(verbs, *list.as_ptr().add(i)) })
            .collect();
        Ok(DeviceList { verbs, list, names })
    }

    /// The devices' names, in list order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Opens device `index` of the list (`ibv_open_device`); the context stays valid
    /// after the list is freed.
    pub fn open(&self, index: usize) -> io::Result<Arc<Context>> {
        let Some(name) = self.names.get(index) else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no device #{index}"),
            ));
        };
        // SAFETY: `index` is within the list, whose device pointers are live until it
        // is freed; the context returned is owned by the `Context` made here.
        let ctx = unsafe { (self.verbs.open_device)(*self.list.as_ptr().add(index)) };
        let ctx = NonNull::new(ctx).ok_or_else(io::Error::last_os_error)?;
        Ok(Arc::new(Context {
            verbs: self.verbs,
            ctx,
            name: name.clone(),
        }))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once, here.
        unsafe { (self.verbs.free_device_list)(self.list.as_ptr()) };
    }
}

/// An opened device (`ibv_open_device`), closed on drop once nothing made from it is
/// left (its children hold an `Arc` of it).
pub struct Context {
    verbs: &'static Verbs,
    ctx: NonNull<ibv::ibv_context>,
    name: String,
}

// SAFETY: a device context may be used from any thread (libibverbs is thread-safe),
// and it is closed only by Drop, when no reference remains.
unsafe impl Send for Context {}
// SAFETY: `&Context` only passes the context to thread-safe libibverbs calls and reads the
// immutable `verbs` table and `name`; closing it needs `&mut` (Drop).
unsafe impl Sync for Context {}

impl Context {
    /// The verbs table the context was opened through.
    pub fn verbs(&self) -> &'static Verbs {
        self.verbs
    }

    /// The device's name (`mlx5_0`, `emu1`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw context, for verbs calls.
    pub fn as_ptr(&self) -> *mut ibv::ibv_context {
        self.ctx.as_ptr()
    }

    /// `ibv_query_port`: the port's state, LID, MTU and link layer.
    pub fn query_port(&self, port: u8) -> Result<ibv::ibv_port_attr, c_int> {
        // SAFETY: the context is open while `self` lives.
        unsafe { self.verbs.query_port(self.as_ptr(), port) }
    }

    /// `ibv_query_gid`: entry `index` of the port's GID table.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<ibv::ibv_gid, c_int> {
        let mut gid = ibv::ibv_gid::default();
        // SAFETY: an open context and a valid out-parameter.
        match unsafe { (self.verbs.query_gid)(self.as_ptr(), port, c_int::from(index), &mut gid) } {
            0 => Ok(gid),
            rc => Err(rc),
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from the context holds an Arc of it, so none is
        // left; the context is closed once, here.
        let rc = unsafe { (self.verbs.close_device)(self.as_ptr()) };
        super::released("ibv_close_device", &self.name, rc);
    }
}

//! `mc_config_*`: an owned [`EngineConfig`] (plus the store's settings) behind an
//! opaque pointer.

use std::ffi::{c_char, c_int};

use super::args::{c_str, non_null};
use super::store::StoreSettings;
use super::{guard, guard_value, init_logging, MC_OK};
use crate::engine::EngineConfig;

/// `mc_config`: engine and store settings, filled key by key before `mc_engine_new`
/// or `mc_store_new`.
pub struct McConfig {
    pub(crate) config: EngineConfig,
    pub(crate) store: StoreSettings,
}

/// A config with the defaults; NULL only if a panic occurred. Free with
/// `mc_config_free`.
#[no_mangle]
pub extern "C" fn mc_config_new() -> *mut McConfig {
    guard_value("mc_config_new", std::ptr::null_mut(), || {
        init_logging();
        Box::into_raw(Box::new(McConfig {
            config: EngineConfig::default(),
            store: StoreSettings::default(),
        }))
    })
}

/// Sets one key, validating it at once; on error the config is unchanged.
///
/// # Safety
/// `cfg` must be NULL or a live pointer from `mc_config_new`, not used by another
/// thread during the call; `key` and `value` must be NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn mc_config_set(
    cfg: *mut McConfig,
    key: *const c_char,
    value: *const c_char,
) -> c_int {
    guard("mc_config_set", || {
        non_null(cfg, "config")?;
        // SAFETY: the caller passes valid strings or NULL (rejected inside).
        let (key, value) = unsafe { (c_str(key, "key")?, c_str(value, "value")?) };
        // SAFETY: non-null, from `mc_config_new`, and not shared during the call.
        let cfg = unsafe { &mut *cfg };
        // Apply to a copy so a half-applied bad value never sticks.
        let (mut next, mut store) = (cfg.config.clone(), cfg.store.clone());
        store.set(&mut next, key, value)?;
        (cfg.config, cfg.store) = (next, store);
        Ok(MC_OK)
    })
}

/// Frees a config; NULL is ignored.
///
/// # Safety
/// `cfg` must be NULL or a pointer from `mc_config_new` not yet freed; it must not be
/// used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mc_config_free(cfg: *mut McConfig) {
    if cfg.is_null() {
        return;
    }
    guard_value("mc_config_free", (), || {
        // SAFETY: `cfg` is non-null (checked above) and, as mooncake.h requires of callers, came
        // from `Box::into_raw` in `mc_config_new` and is freed only this once.
        drop(unsafe { Box::from_raw(cfg) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_value_leaves_the_config_unchanged() {
        let cfg = mc_config_new();
        // SAFETY: `cfg` is live until freed at the end; strings are literals.
        unsafe {
            assert_eq!(
                mc_config_set(cfg, c"workers".as_ptr(), c"3".as_ptr()),
                MC_OK
            );
            // `set` has already stored 0 in its copy when it refuses the value.
            assert!(mc_config_set(cfg, c"workers".as_ptr(), c"0".as_ptr()) < 0);
            assert!(mc_config_set(cfg, c"slice_size".as_ptr(), c"1".as_ptr()) < 0);
            assert_eq!((*cfg).config.workers, 3);
            assert_eq!(
                (*cfg).config.tcp.slice_size,
                EngineConfig::default().tcp.slice_size
            );
            mc_config_free(cfg);
        }
    }
}

//! `function_table!`: one declaration per runtime-loaded library, from which both the
//! table struct and the code that fills it from the loaded library are generated, so a
//! field and its symbol lookup can never drift apart.
//!
//! ```text
//! function_table! {
//!     /// Docs of the table.
//!     pub struct Table (override MC_X_LIB) {
//!         // State beside the function pointers, with its initial value.
//!         state {
//!             init_error: Option<DriverError> = None,
//!         }
//!         // Entry points: `required` (a missing one fails the load) or `optional`
//!         // (an `Option`), each with the names tried in order (versioned names first).
//!         symbols {
//!             pub x_init: required ["xInit"] unsafe extern "C" fn(c_uint) -> c_int,
//!             pub x_new: optional ["xNew_v2", "xNew"] unsafe extern "C" fn() -> c_int,
//!         }
//!     }
//! }
//! ```
//!
//! Every table also gets `library: String` (the name or path it was opened under) and
//! keeps its `Arc<Library>`, and `fn bind(lib, library) -> Result<Table>` that looks up
//! every symbol. Declaring an entry point is the promise that its field type is the C
//! prototype of every name listed; `bind` relies on it.

macro_rules! function_table {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident (override $var:expr) {
            state {
                $(
                    $(#[$smeta:meta])*
                    $svis:vis $sfield:ident : $sty:ty = $sinit:expr
                ),* $(,)?
            }
            symbols {
                $(
                    $(#[$fmeta:meta])*
                    $fvis:vis $field:ident : $kind:ident [$($sym:literal),+] $fty:ty
                ),* $(,)?
            }
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            _lib: ::std::sync::Arc<::libloading::Library>,
            /// The name or path the library was opened under.
            pub library: String,
            $( $(#[$smeta])* $svis $sfield: $sty, )*
            $( $(#[$fmeta])* $fvis $field: function_table!(@type $kind $fty), )*
        }

        impl $name {
            /// Looks up every entry point in `lib`, opened under the name `library`.
            fn bind(
                lib: ::std::sync::Arc<::libloading::Library>,
                library: String,
            ) -> $crate::error::Result<$name> {
                Ok($name {
                    $(
                        $field: function_table!(
                            @lookup $kind, &lib, &library, $var, [$($sym),+], $fty
                        ),
                    )*
                    $( $sfield: $sinit, )*
                    library,
                    _lib: lib,
                })
            }
        }
    };
    (@type required $fty:ty) => { $fty };
    (@type optional $fty:ty) => { Option<$fty> };
    (@lookup required, $lib:expr, $library:expr, $var:expr, [$($sym:literal),+], $fty:ty) => {
        // SAFETY: the table's declaration gives this field's type as the C prototype of
        // every symbol listed for it.
        unsafe { $crate::loader::symbol::<$fty>($lib, $library, &[$($sym),+], $var) }?
    };
    (@lookup optional, $lib:expr, $library:expr, $var:expr, [$($sym:literal),+], $fty:ty) => {
        // SAFETY: as for a required entry point.
        unsafe { $crate::loader::symbol::<$fty>($lib, $library, &[$($sym),+], $var) }.ok()
    };
}

pub(crate) use function_table;

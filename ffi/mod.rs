//! Runtime-loaded native libraries.

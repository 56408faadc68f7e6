"""The ctypes signatures the package declares (``_native._SIGNATURES``) against the C
header they bind (``c_include/mooncake.h``): every function of the header is declared,
none the header lacks, each with the header's arity and argument and result kinds. A
prototype changed on one side only fails here, not as memory corruption at run time."""

import ctypes
import pathlib
import re

import pytest

N = pytest.importorskip("mooncake._native")

HEADER = pathlib.Path(__file__).resolve().parents[2] / "c_include" / "mooncake.h"

# Functions the package does not call (with why).
NOT_BOUND = {
    "mc_version": "the package reports its own version (mooncake.__version__)",
}

# Scalars by C name; `void` results are None.
SCALARS = {
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "uint64_t": ctypes.c_uint64,
    "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32,
    "uint16_t": ctypes.c_uint16,
    "uint8_t": ctypes.c_uint8,
    "double": ctypes.c_double,
}


def _prototypes():
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*|#[^\n]*", " ", text)
    found = {}
    pattern = r"([A-Za-z_][\w\s*]*?)\b(mc_\w+)\s*\(((?:[^()]|\([^()]*\))*)\)\s*;"
    for m in re.finditer(pattern, text):
        ret, name, args = (g.strip() for g in m.groups())
        if ret.startswith("typedef"):
            continue
        args = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        found[name] = (ret, args)
    return found


def _c_type(decl):
    """(is_pointer, scalar name) of a parameter declaration or result type."""
    # A type named *_fn is a function pointer typedef (mc_alloc_fn).
    pointer = "*" in decl or "[" in decl or "(" in decl or bool(re.search(r"\w_fn\b", decl))
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in ("const", "struct")]
    return pointer, (words[0] if words else "")


def _matches(decl, ctype):
    pointer, base = _c_type(decl)
    if not pointer:
        if base == "void":
            return ctype is None
        return ctype is SCALARS.get(base, object())
    # Any pointer: an opaque address, a C string, a typed pointer or a callback.
    return ctype in (ctypes.c_void_p, ctypes.c_char_p) or (
        isinstance(ctype, type) and issubclass(ctype, (ctypes._Pointer, ctypes._CFuncPtr)))


def test_every_header_function_is_declared_and_nothing_else():
    protos = _prototypes()
    assert len(protos) > 50, "the header parser found too little"
    declared = set(N._SIGNATURES)
    assert sorted(set(protos) - declared - set(NOT_BOUND)) == []
    assert sorted(declared - set(protos)) == []


@pytest.mark.parametrize("name", sorted(N._SIGNATURES))
def test_declared_signature_matches_the_header(name):
    ret, args = _prototypes()[name]
    restype, argtypes = N._SIGNATURES[name]
    assert _matches(ret, restype), f"{name}: returns {ret!r}, declared {restype}"
    assert len(argtypes) == len(args), f"{name}: header {args}, declared {argtypes}"
    for decl, ctype in zip(args, argtypes):
        assert _matches(decl, ctype), f"{name}: {decl!r} declared as {ctype}"


def test_the_package_expects_the_header_abi():
    text = HEADER.read_text()
    version = int(re.search(r"#define MC_ABI_VERSION (\d+)", text).group(1))
    revision = int(re.search(r"#define MC_ABI_REVISION (\d+)", text).group(1))
    assert (N.EXPECTED_ABI_VERSION, N.EXPECTED_ABI_REVISION) == (version, revision)
    assert (N.ABI_VERSION, N.ABI_REVISION) == (version, revision), "the library loaded"


def test_a_library_lacking_a_function_is_refused_naming_it():
    class Partial:
        """A library with every function but one."""

        def __getattr__(self, name):
            if name == "mc_store_health":
                raise AttributeError(name)
            return getattr(N._cdll, name)

    with pytest.raises(ImportError, match="mc_store_health"):
        N._Lib(Partial(), "/old/libmooncake.so")

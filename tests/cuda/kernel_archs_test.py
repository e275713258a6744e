"""The CUDA objects hold the GPU code the dispatch expects (layers/core/fused_switch.h): every kernel source
sm_90a code; every one but the delta rule's (layers/kernels/delta_rule/*.cu, layers/kernels/log_linear/walk.cu)
sm_100a code too. Reads each object's .nv_fatbin section (the fat binaries nvcc embeds: a 16-byte header
with magic 0xBA55ED50 and the size of its entries; an entry's header gives its kind, 2 for a cubin, its
header and payload sizes, and the SM version at byte 28), so no CUDA tool is needed.

  python3 tests/cuda/kernel_archs_test.py OBJECT.cu.o ...
"""
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def section(data, wanted):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size
    _, stroff, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end].decode() == wanted:
            return data[offset:offset + size]
    return b""


def cubin_archs(fatbins):
    archs, pos = set(), 0
    while pos + 16 <= len(fatbins):
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", fatbins, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned in the section
            continue
        entry, end = pos + header_size, pos + header_size + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", fatbins, entry)
            arch, = struct.unpack_from("<I", fatbins, entry + 28)
            if kind == 2:
                archs.add(arch)
            entry += entry_header + payload
        pos = end
    return archs


def main(objects):
    failures, checked, blackwell = [], 0, 0
    for path in objects:
        if not path.endswith(".cu.o"):
            continue
        archs = cubin_archs(section(open(path, "rb").read(), ".nv_fatbin"))
        if not archs:
            continue  # a CUDA source without kernels
        checked += 1
        hopper_only = "/layers/kernels/delta_rule/" in path or path.endswith("/layers/kernels/log_linear/walk.cu.o")
        want = {90} if hopper_only else {90, 100}
        if archs != want:
            failures.append(f"{path}: cubins for SM {sorted(archs)}, expected {sorted(want)}")
        blackwell += 100 in archs
    if checked < 15:
        failures.append(f"only {checked} objects with cubins among {len(objects)} arguments")
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print(f"OK: {checked} objects with cubins, {blackwell} of them also for sm_100a")
    return 1 if failures else 0


if __name__ == "__main__":
    # CTest passes $<TARGET_OBJECTS:...> as one ';'-separated argument.
    sys.exit(main([p for a in sys.argv[1:] for p in a.split(";") if p]))

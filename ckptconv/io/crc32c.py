"""CRC-32C (Castagnoli, reflected, as absl/riegeli compute it): the checksum that seals every OCDBT
manifest and node (readers/ocdbt_encoding.py) and a zarr v3 sharding_indexed shard's index
(readers/zarr_codecs.py). Long inputs are fed as numpy lanes side by side, then combined."""


def _crc_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC = _crc_table()


def _crc_bytes(crc: int, data) -> int:
    table = _CRC
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def _shift_columns(n: int):
    """The linear map "feed n zero bytes" on a CRC register, as the images of its 32 unit vectors."""
    def apply(cols, v):
        out = 0
        for i in range(32):
            if v >> i & 1:
                out ^= cols[i]
        return out
    result = [1 << i for i in range(32)]                       # identity
    step = [_crc_bytes(1 << i, b"\0") for i in range(32)]      # one zero byte
    while n:
        if n & 1:
            result = [apply(step, c) for c in result]
        step = [apply(step, c) for c in step]
        n >>= 1
    return result


_LANE = 1024           # bytes each numpy lane feeds before the lanes are combined
_SMALL = 16 << 10      # below this, the plain byte loop


def crc32c(data) -> int:
    """CRC-32C of `data`. Long inputs are split into 2**k lanes of about _LANE bytes fed side by side with
    numpy (the register update is linear, so a lane starting from 0 contributes independently of the
    others), then combined pairwise: (left shifted by len(right) zero bytes) ^ right."""
    data = memoryview(data).cast("B")
    if len(data) < _SMALL:
        return _crc_bytes(0xFFFFFFFF, data) ^ 0xFFFFFFFF
    import numpy as np
    lanes = 1 << ((len(data) // _LANE).bit_length() - 1)
    width = len(data) // lanes                 # _LANE .. 2 * _LANE - 1; fewer than `lanes` bytes left over
    body = lanes * width
    grid = np.frombuffer(data[:body], dtype=np.uint8).reshape(lanes, width).T.copy()
    table = np.array(_CRC, dtype=np.uint32)
    state = np.zeros(lanes, dtype=np.uint32)
    state[0] = 0xFFFFFFFF
    for row in grid:
        state = table[(state ^ row) & 0xFF] ^ (state >> 8)
    while len(state) > 1:
        cols = _shift_columns(width)
        left, right = state[0::2], state[1::2]
        shifted = np.zeros_like(left)
        for i in range(32):
            shifted ^= np.where(left >> i & 1, np.uint32(cols[i]), np.uint32(0))
        state = shifted ^ right
        width *= 2
    return _crc_bytes(int(state[0]), data[body:]) ^ 0xFFFFFFFF

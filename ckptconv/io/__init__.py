"""Storage I/O: mapped input files (mapped.py), the write pipeline that hashes as it writes
(hashing.py over outfile.py's O_DIRECT staging), SHA-256 streams (sha256.py), atomic
publication of an output (output.py), decompressed bytes spilled to a temporary file (spill.py),
bounded zstd decompression (zstd.py) and CRC-32C (crc32c.py). Nothing here knows a checkpoint format."""

"""Storage I/O: mapped input files (mapped.py), the write pipeline that hashes as it writes
(hashing.py over outfile.py's O_DIRECT staging), SHA-256 streams (sha256.py) and atomic
publication of an output (output.py). Nothing here knows a checkpoint format."""

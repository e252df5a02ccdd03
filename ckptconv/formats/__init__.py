"""Every on-disk format ckptconv reads or writes, each in one module, both directions: safetensors
headers, the output directory's metadata (index, manifest, resume journal), SHA256SUMS, and a
reshard output's mesh.json with its rank directories. Other modules take file names and format
tags from here, never spelling them out."""

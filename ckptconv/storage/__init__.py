"""Object storage (s3://, gs://, az://, abfs://) for checkpoints read and outputs written there
(docs/architecture.md; bounds in docs/security.md). obstore is an optional extra (`ckptconv[cloud]`):
nothing here imports it until a URL is opened.

- `urls`: which text is a URL, what it names (`Location`), the options (`StorageOptions`), the store
  that reaches it, and the one-line, credential-free messages of its failures.
- `objects`: a source object (`SourceObject`: identity, small reads, ranged GETs streamed in a
  bounded window, retried) and the listing of a prefix.
- `upload`: an output object written as a stream (`ObjectWriter`: multipart, hashed in the same
  pass) and one OUT's life (`Publisher`: the lock, what was created, the pointer written last,
  the rollback).
- `s3api`: the S3 calls obstore does not make (list and abort pending multipart uploads; a multipart
  upload of our own completed with `If-None-Match: *`), signed with AWS Signature Version 4.
- `targets`: where an output's bytes go (a local directory or a prefix: `Target`), and a bucket OUT's
  life (`bucket_output`: claimed, written, published pointer last, or rolled back).
"""

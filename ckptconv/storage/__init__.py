"""Where bytes come from and go: local paths and object stores (s3://, gs://, az://, abfs://) behind one
interface (docs/architecture.md; bounds in docs/security.md). obstore is an optional extra
(`ckptconv[cloud]`): nothing here imports it until a URL is opened.

Sources:
- `files`: the one way readers and layouts reach files; it dispatches on the path's backend
  (`backend`: the interface; `local`: paths; `bucket`: a job's object-store `Session`, its options,
  clients, listings and objects opened; `remote`: `RemotePath`, a URL bound to its session, and
  `RemoteFile`, an object behind a mapped file's interface).
- `window`: the one read-ahead window of concurrent ranged GETs.
- `objects`: a source object (`SourceObject`: identity, small reads, ranged GETs, retried) and the
  paged, bounded listing of a prefix.
- `urls`: which text is a URL, what it names (`Location`), the options (`StorageOptions`), the store
  that reaches it, and the one-line, credential-free messages of its failures.

Outputs:
- `writer`: an output object written as a stream (`ObjectWriter`: multipart, hashed in the same
  pass) and the pointer written last (`PointerWriter`).
- `lease`: OUT's lock object (`Lease`: claimed create-only, a heartbeat, taken over only when asked).
- `publisher`: one OUT's life (`Publisher`: what was created, the pointer last, the rollback).
- `s3api`: the S3 calls obstore does not make (list and abort pending multipart uploads; a multipart
  upload of our own completed with `If-None-Match: *`), signed with AWS Signature Version 4.
- `targets`: where an output's bytes go (a local directory or a prefix: `Target`), and a bucket OUT's
  life (`bucket_output`: claimed, written, published pointer last, or rolled back).
"""

"""What every room of the rendezvous stands on, and nothing above it: the key-value store interface and the
errors every store raises, the job token that signs every value, the records kept in the store and the
checks each passes when read, the pure arithmetic of a round's membership, and the job-level key names.

Nothing here opens a store or names a round's key: the stores (c10d/, etcd/) implement
`kv.KeyValueStore`, the round protocol (the package's root) runs on it.
"""

"""The rendezvous store on an etcd cluster: the store, its client of etcd's JSON gateway with fail-over
between members, one keep-alive HTTP/TLS connection, the TLS and user settings, and the first connect
with one line saying why it failed.
"""

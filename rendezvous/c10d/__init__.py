"""The c10d stores: torch's `TCPStore` and `FileStore` wrapped to speak seconds and clear exceptions, a
connect to a TCPStore that never hangs, and a torch-free reader of the TCPStore's wire protocol for
`rally status`.
"""

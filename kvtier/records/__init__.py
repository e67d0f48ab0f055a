"""The record layer: the bytes a byte backend stores, and how they are checked.

It owns the versioned record header and meta record (``format``), codecs (``codec``), and
checking or encoding a job's records on a side thread (``checks``). Change the on-disk format
here and nowhere else. It never keeps key state and never imports the manager or a backend.
"""

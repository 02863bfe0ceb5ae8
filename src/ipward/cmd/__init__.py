"""The command line: `ipward` and its commands (`cli`), the daemons' shared edge
(`daemon`), the plugin launcher `install-cni` writes (`install`)."""

"""The command line: `ipward` and its commands (`cli`), the daemons' commands (`agent`,
`controller`) on their shared scaffold (`daemon`). What `install-cni` writes is built
by `ipward.core.startpath`."""

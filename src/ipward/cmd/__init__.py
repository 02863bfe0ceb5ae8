"""The command line: `ipward` and its commands (`cli`), the daemons' commands (`agent`,
`controller`) on their shared scaffold (`daemon`), the plugin launcher `install-cni`
writes (`install`) and the standalone plugin it builds (`standalone_build`)."""

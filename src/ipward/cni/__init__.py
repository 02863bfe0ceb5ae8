"""The CNI plugin: the executable's entry (`plugin`), its protocol to the agent (`wire`),
the verbs (`verbs`), the network config (`config`) and which pools an ADD uses
(`selection`). On every pod's start path: kept empty."""

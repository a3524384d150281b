// Command endpoint-picker is the endpoint picker pdstack renders (gateway_epp): the Gateway API
// Inference Extension's EPP runner at v1.4.0, the version llm-d-inference-scheduler v0.7.1 is
// built on, with the llm-d v0.7.1 plugins pdstack's EndpointPickerConfig names
// (infra/render/router_config.py epp_config) registered on it. The twin runs it for the picker's
// pod (/app/epp), with the rendered flags and config.
//
// Why not llm-d's own cmd/epp: its plugin registry (pkg/plugins/register.go) imports the precise
// prefix-cache scorer and the tokenizer, which import github.com/llm-d/llm-d-kv-cache, and the Go
// module proxy refuses every version of that module (403). This main does what llm-d's
// cmd/epp/main.go does (register llm-d's plugins, then runner.NewRunner() with llm-d's metrics
// collectors) for the plugin types that need no llm-d-kv-cache; the ones left out are
// precise-prefix-cache-scorer, load-aware-scorer, session-affinity-scorer, active-request-scorer,
// no-hit-lru-scorer (one Go package with the precise scorer), tokenizer, and llm-d's
// models data source, which pdstack renders none of. Tracing is the runner's own (--tracing).
package main

import (
	"os"

	"github.com/llm-d/llm-d-inference-scheduler/pkg/metrics"
	"github.com/llm-d/llm-d-inference-scheduler/pkg/plugins/filter"
	prerequest "github.com/llm-d/llm-d-inference-scheduler/pkg/plugins/pre-request"
	"github.com/llm-d/llm-d-inference-scheduler/pkg/plugins/profile"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
)

func main() {
	// As llm-d's pkg/plugins/register.go registers them (the GIE plugins the config names, such as
	// prefix-cache-scorer and max-score-picker, the runner registers itself).
	plugin.Register(filter.ByLabelType, filter.ByLabelFactory)
	plugin.Register(filter.ByLabelSelectorType, filter.ByLabelSelectorFactory)
	plugin.Register(filter.EncodeRoleType, filter.EncodeRoleFactory)
	plugin.Register(filter.DecodeRoleType, filter.DecodeRoleFactory)
	plugin.Register(filter.PrefillRoleType, filter.PrefillRoleFactory)
	plugin.Register(prerequest.DisaggHeadersHandlerType, prerequest.DisaggHeadersHandlerFactory)
	plugin.Register(profile.DataParallelProfileHandlerType, profile.DataParallelProfileHandlerFactory)
	plugin.Register(profile.DisaggProfileHandlerType, profile.DisaggProfileHandlerFactory)
	plugin.Register(profile.PrefixBasedPDDeciderPluginType, profile.PrefixBasedPDDeciderPluginFactory)
	plugin.Register(profile.AlwaysDisaggPDDeciderPluginType, profile.AlwaysDisaggPDDeciderPluginFactory)
	plugin.Register(profile.AlwaysDisaggMulimodalPluginType, profile.AlwaysDisaggMulimodalDeciderPluginFactory)
	if err := runner.NewRunner().WithCustomCollectors(metrics.GetCollectors()...).Run(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}

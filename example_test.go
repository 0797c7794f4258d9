package conveyor_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/conveyorhq/conveyor"
)

// A handler for a "reports.build" task type. Register it with
// worker.Main(conveyor.Handle("reports.build", buildReport)) in your own
// main package to get a worker binary that runs it.
func buildReport(ctx context.Context, t conveyor.Task, r conveyor.Reporter) (any, error) {
	var in struct {
		Sections []string `json:"sections"`
	}
	if err := json.Unmarshal(t.Payload, &in); err != nil {
		// Retrying cannot fix a bad payload.
		return nil, conveyor.Permanent(fmt.Errorf("bad payload: %w", err))
	}
	for i, s := range in.Sections {
		if err := ctx.Err(); err != nil {
			return nil, context.Cause(ctx) // cancelled, lost or shutting down
		}
		// ... build section s ...
		if err := r.Progress(ctx, (i+1)*100/len(in.Sections), "Built "+s); err != nil {
			return nil, err
		}
	}
	return map[string]any{"url": "s3://reports/" + t.ID.String() + ".pdf", "sections": len(in.Sections)}, nil
}

// printReporter prints reports instead of storing them.
type printReporter struct{}

func (printReporter) Progress(_ context.Context, percent int, state string) error {
	fmt.Printf("%3d%% %s\n", percent, state)
	return nil
}

// Gather would spawn the children; this reporter runs none.
func (printReporter) Gather(context.Context, ...conveyor.Child) ([]conveyor.ChildResult, error) {
	return nil, errors.New("no children in an example")
}

func ExampleHandle() {
	h := conveyor.Handle("reports.build", buildReport)

	// The worker calls the handler like this for every task it claims.
	result, err := h.Func(context.Background(), conveyor.Task{
		Type: h.Type, Payload: json.RawMessage(`{"sections": ["sales", "costs"]}`), Attempt: 1, MaxAttempts: 3,
	}, printReporter{})
	fmt.Println(result, err)

	_, err = h.Func(context.Background(), conveyor.Task{Type: h.Type, Payload: json.RawMessage(`[]`)}, printReporter{})
	fmt.Println(conveyor.IsPermanent(err), err)
	// Output:
	//  50% Built sales
	// 100% Built costs
	// map[sections:2 url:s3://reports/00000000-0000-0000-0000-000000000000.pdf] <nil>
	// true bad payload: json: cannot unmarshal array into Go value of type struct { Sections []string "json:\"sections\"" }
}

func ExamplePermanent() {
	err := fmt.Errorf("charge card: %w", conveyor.Permanent(errors.New("card declined")))
	fmt.Println(conveyor.IsPermanent(err), conveyor.IsPermanent(errors.New("timeout")), conveyor.Permanent(nil))
	// Output: true false <nil>
}

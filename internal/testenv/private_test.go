package testenv_test

import (
	"context"
	"github.com/conveyorhq/conveyor/internal/testenv"
	"github.com/jackc/pgx/v5"
	"testing"
)

func TestPrivateServers(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPG(t)
	c, err := pgx.Connect(context.Background(), pg.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close(context.Background())
	pg.Stop(t)
	pg.Start(t)
	c, err = pgx.Connect(context.Background(), pg.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close(context.Background())
}

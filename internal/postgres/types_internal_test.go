package postgres

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"
)

// A registered map neither formats an id it sends nor parses one it reads:
// pgx's plans for uuid.UUID otherwise go through its driver.Valuer and
// sql.Scanner (text).
func TestRegisteredUUIDPlansSkipText(t *testing.T) {
	m := pgtype.NewMap()
	registerTypes(m)
	for _, v := range []any{uuid.New(), []uuid.UUID{uuid.New()}} {
		oid := uint32(pgtype.UUIDOID)
		if _, ok := v.([]uuid.UUID); ok {
			oid = pgtype.UUIDArrayOID
		}
		plan := m.PlanEncode(oid, pgtype.BinaryFormatCode, v)
		require.NotNil(t, plan)
		require.NotContains(t, fmt.Sprintf("%T", plan), "DriverValuer", "%T", v)
	}
	var u uuid.UUID
	require.IsType(t, scanBinaryUUID{}, m.PlanScan(pgtype.UUIDOID, pgtype.BinaryFormatCode, &u))
}
